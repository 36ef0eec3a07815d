#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
NEW="PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests"
OLD="PYTHONPATH=/tmp/site:$PWD/scratch/old/src:$PWD/tests"
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
env $NEW timeout 120 python -m pytest -q -m gpu tests/unit/train -x 2>&1 | tail -5 > $OUT/gpu_tests.txt
B="--model llama-3.2-1b --tenants 32 --duration 10 --fleet= --no-peft --sdk-processes 4"
env $NEW timeout 200 python benchmarks/hosted_training.py $B --paths engine,sdk > $OUT/new1.jsonl 2> $OUT/new1.err
env $OLD timeout 200 python scratch/old/benchmarks/hosted_training.py $B --paths engine,sdk > $OUT/old1.jsonl 2> $OUT/old1.err
env $NEW timeout 150 python benchmarks/hosted_training.py $B --paths sdk > $OUT/new2.jsonl 2> $OUT/new2.err
tail -c 3000 $OUT/*.err | grep -v "^$" | tail -20
cat $OUT/gpu_tests.txt $OUT/*.jsonl
