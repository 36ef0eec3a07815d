#!/usr/bin/env bash
# one 2xH200 call: the 4-thread nccl:// fleet without CUDA_DEVICE_MAX_CONNECTIONS (did the hang go with the
# shared TCPStore?), then one client thread (in process and nccl://) and one client process, under MPS
export CUDA_MPS_PIPE_DIRECTORY=/tmp/symbiosis-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/symbiosis-mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "== MPS started"
trap 'echo quit | timeout 20 nvidia-cuda-mps-control' EXIT
B="python benchmarks/multi_tenant.py --model llama-3.2-1b --duration 5 --no-plain --client-device cuda:1"
run() { name=$1; limit=$2; shift 2; echo "== $name: $*"; s=$SECONDS
  timeout $limit "$@" > $OUT/$name.log 2>&1; echo "== $name: rc $? $((SECONDS-s)) s"; grep -E '^\{' $OUT/$name.log | cut -c1-700; }
run threads4_nccl_default_queues 150 env TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$OUT/nccl_trace_ $B --tenants 4 --clients threads --executor nccl:cuda:0
run one_thread 150 $B --tenants 1 --clients threads --executor local --executor nccl:cuda:0
run one_process 120 $B --tenants 1 --clients processes --executor nccl:cuda:0
