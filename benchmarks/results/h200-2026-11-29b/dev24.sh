#!/bin/bash
# run from the repo root on the device; .base24/ = `git archive 5052d19 src benchmarks` (the tree before), carried with .whl and this script
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi > $OUT/nvidia-smi.txt
T=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
start=$(date +%s)
timeout ${TESTS_S:-170} python3 -m pytest -q -m gpu -p no:cacheprovider -p no:logging --tb=short ${TESTS:-tests/unit/engine} > $OUT/gpu_tests.txt 2>&1
echo "tests $(( $(date +%s) - start )) s" >> $OUT/times.txt
ARGS="--model llama-3.2-1b --tenants 1000 --distinct 20 --clients 64 --rank 64 --targets $T --slots 32 --host-gib 24 --phases placement,prefetch --wave-bytes ${WAVE_BYTES:-100000000} --samples ${SAMPLES:-80} --prefetch-loads ${LOADS:-idle,loaded} --workdir /tmp/hmi"
n=0
for tree in ${TREES:-new old}; do
  n=$((n+1)); start=$(date +%s)
  if [ $tree = new ]; then
    timeout ${RUN_S:-190} python3 benchmarks/hmi.py $ARGS > $OUT/$tree$n.jsonl 2> $OUT/$tree$n.log
  else
    PYTHONPATH=/tmp/site:$PWD/.base24/src:$PWD/tests timeout ${RUN_S:-190} python3 benchmarks/hmi.py $ARGS > $OUT/$tree$n.jsonl 2> $OUT/$tree$n.log
  fi
  echo "$tree $(( $(date +%s) - start )) s" >> $OUT/times.txt
done
cat $OUT/gpu_tests.txt | tail -5; cat $OUT/times.txt
for f in $OUT/*.jsonl; do python3 -c "
import json,sys
for l in open('$f'):
    d=json.loads(l)
    print('$f', d.get('phase'), {k: (round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k.endswith(('added_ms','hidden','copy_ms','host_ms','cpu_ms','resident_ms','ci95'))})
"; done
