#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/unit/train 2>&1 | tail -3 > $OUT/gpu_tests.txt
timeout 240 bash benchmarks/run_all.sh hosted_sdk_processes > $OUT/run_all.log 2>&1
timeout 150 python benchmarks/hosted_training.py --model llama-3.2-1b --tenants 8 --duration 8 --fleet= --no-peft --sdk-processes 4 --paths engine,sdk > $OUT/t8.jsonl 2> $OUT/t8.err
cat $OUT/gpu_tests.txt
for f in $OUT/run_all.log $OUT/t8.jsonl; do echo "== $f"; grep '^{' $f | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); print(d['system'][:22], d['tenants'], round(d['tokens_per_s']), round(d['datums_per_pass'],1), d.get('overlapped_share'), d['runner_share'], d.get('graphs_in_window'))"; done
tail -5 $OUT/run_all.log
