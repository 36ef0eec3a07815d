#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
NEW="PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests"
OLD="PYTHONPATH=/tmp/site:$PWD/scratch/old/src:$PWD/tests"
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
B="--model llama-3.2-1b --duration 8 --fleet= --no-peft --sdk-processes 4"
env $NEW timeout 150 python benchmarks/hosted_training.py $B --tenants 8 --paths engine,sdk > $OUT/new8.jsonl 2> $OUT/new8.err
env $OLD timeout 150 python scratch/old/benchmarks/hosted_training.py $B --tenants 8 --paths engine,sdk > $OUT/old8.jsonl 2> $OUT/old8.err
env $NEW timeout 120 python benchmarks/hosted_training.py $B --tenants 1 --paths engine,sdk --sdk-processes 1 > $OUT/new1t.jsonl 2> $OUT/new1t.err
env $OLD timeout 120 python scratch/old/benchmarks/hosted_training.py $B --tenants 1 --paths engine,sdk --sdk-processes 1 > $OUT/old1t.jsonl 2> $OUT/old1t.err
tail -c 1500 $OUT/*.err | grep -iv "^$\|shards" | tail -12
for f in $OUT/*.jsonl; do echo "== $f"; python3 -c "
import json,sys
for l in open('$f'):
  if l.startswith('{'):
    d=json.loads(l); print(d['system'][:22], d['tenants'], round(d['tokens_per_s']), round(d['datums_per_pass'],1), d.get('overlapped_share'), d['runner_share'], d.get('graphs_in_window'))"; done
