#!/usr/bin/env bash
# one 2xH200 call: nccl:// with a lone client's calls chained on the executor's GPU (this tree) against the tree
# before (.baseline: host waits for each input, then the batcher), and in process; MPS, 32 hardware queues
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
NEW=/tmp/site:$PWD/src:$PWD/tests; OLD=/tmp/site:$PWD/.baseline/src:$PWD/tests
export PYTHONPATH=$NEW
nvidia-smi -L > $OUT/nvidia-smi.txt
s=$SECONDS
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/unit/transport/test_collective.py 2>&1 | grep -v DEBUG | tail -25 > $OUT/gpu_tests.txt; tail -4 $OUT/gpu_tests.txt
echo "== tests $((SECONDS-s)) s"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/symbiosis-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/symbiosis-mps-log CUDA_DEVICE_MAX_CONNECTIONS=32
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "== MPS started"
trap 'echo quit | timeout 20 nvidia-cuda-mps-control' EXIT
# CHAIN=0 ROUNDS=1: the short version (~310 s): the GPU test and one fleet round
if [[ ${CHAIN:-1} == 1 ]]; then
for tree in NEW OLD; do
  export PYTHONPATH=${!tree}; B=benchmarks; [[ $tree == OLD ]] && B=.baseline/benchmarks
  timeout 100 python3 $B/remote_chain.py --model llama-3.2-1b --client-device cuda:1 --steps layer,tail --repeats 3 --paths nccl 2>/dev/null | sed "s/^{/{\"tree\": \"$tree\", /" >> $OUT/chain.jsonl
done
export PYTHONPATH=$NEW
timeout 60 python3 benchmarks/remote_chain.py --model llama-3.2-1b --client-device cuda:1 --steps layer,tail --repeats 3 --paths in_process 2>/dev/null | sed "s/^{/{\"tree\": \"NEW\", /" >> $OUT/chain.jsonl
cut -c1-300 $OUT/chain.jsonl
echo "== chain $((SECONDS-s)) s"
fi
F="--model llama-3.2-1b --tenants 1 --duration 10 --no-plain --clients threads --client-device cuda:1"
for round in $(seq ${ROUNDS:-2}); do
  export PYTHONPATH=$NEW
  timeout 110 python3 benchmarks/multi_tenant.py $F --executor local --executor nccl:cuda:0 > $OUT/fleet_new_$round.log 2>&1; echo "new rc $?"
  export PYTHONPATH=$OLD
  timeout 70 python3 .baseline/benchmarks/multi_tenant.py $F --executor nccl:cuda:0 > $OUT/fleet_old_$round.log 2>&1; echo "old rc $?"
  echo "== round $round $((SECONDS-s)) s"
done
grep -h '^{' $OUT/fleet_*.log | cut -c1-400
true
