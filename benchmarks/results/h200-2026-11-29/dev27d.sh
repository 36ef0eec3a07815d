#!/usr/bin/env bash
# the short version of dev27c.sh (device time left ~400 s): the nccl GPU test, then one client thread in process /
# nccl:// chained (this tree) / nccl:// before (.baseline), one round, MPS, 32 queues
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
NEW=/tmp/site:$PWD/src:$PWD/tests; OLD=/tmp/site:$PWD/.baseline/src:$PWD/tests
export PYTHONPATH=$NEW
s=$SECONDS
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/unit/transport/test_collective.py 2>&1 | grep -v DEBUG | tail -25 > $OUT/gpu_tests.txt; tail -4 $OUT/gpu_tests.txt
echo "== tests $((SECONDS-s)) s"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/symbiosis-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/symbiosis-mps-log CUDA_DEVICE_MAX_CONNECTIONS=32
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "== MPS started"
trap 'echo quit | timeout 20 nvidia-cuda-mps-control' EXIT
F="--model llama-3.2-1b --tenants 1 --duration 8 --no-plain --clients threads --client-device cuda:1"
timeout 110 python3 benchmarks/multi_tenant.py $F --executor local --executor nccl:cuda:0 > $OUT/fleet_new.log 2>&1; echo "new rc $?"
export PYTHONPATH=$OLD
timeout 70 python3 .baseline/benchmarks/multi_tenant.py $F --executor nccl:cuda:0 > $OUT/fleet_old.log 2>&1; echo "old rc $?"
echo "== $((SECONDS-s)) s"
grep -h '^{' $OUT/fleet_*.log | cut -c1-400
true
