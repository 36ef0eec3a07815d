#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
NEW="PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests"
OLD="PYTHONPATH=/tmp/site:$PWD/scratch/old/src:$PWD/tests"
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
B="--model llama-3.2-1b --tenants 32 --duration 10 --fleet= --no-peft --sdk-processes 4 --loop ahead"
env $NEW timeout 200 python benchmarks/hosted_training.py $B --paths engine,sdk > $OUT/new_ahead.jsonl 2> $OUT/new_ahead.err
env $OLD timeout 200 python scratch/old/benchmarks/hosted_training.py $B --paths engine,sdk > $OUT/old_ahead.jsonl 2> $OUT/old_ahead.err
tail -c 1500 $OUT/*.err | grep -iv "^$\|shards" | tail -12
for f in $OUT/*.jsonl; do echo "== $f"; python3 -c "
import json,sys
for l in open('$f'):
  if l.startswith('{'):
    d=json.loads(l); print(d['system'][:22], d['tenants'], round(d['tokens_per_s']), round(d['datums_per_pass'],1), d.get('overlapped_share'), d['runner_share'], d.get('graphs_in_window'))"; done
