#!/usr/bin/env bash
# one 2xH200 call, 32 hardware queues: one client thread, in process / nccl:// / nccl:// with inline calls on the
# plane thread, alternated three rounds in one process (issue 27's verdict, and the inline hop's worth)
export CUDA_MPS_PIPE_DIRECTORY=/tmp/symbiosis-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/symbiosis-mps-log CUDA_DEVICE_MAX_CONNECTIONS=32
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "== MPS started"
trap 'echo quit | timeout 20 nvidia-cuda-mps-control' EXIT
E="--executor local --executor nccl:cuda:0 --executor nccl-inline:cuda:0"
s=$SECONDS
timeout 540 python benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 1 --duration 8 --no-plain --clients threads $E $E $E --client-device cuda:1 > $OUT/tails_inline.log 2>&1
echo "== rc $? $((SECONDS-s)) s"
grep -E '^\{' $OUT/tails_inline.log | cut -c1-900
