#!/usr/bin/env bash
# Every GPU benchmark of docs/PERFORMANCE.md, in one go, each under its own time limit so that one slow
# benchmark cannot starve the rest; logs and JSON lines go to $OUT (default ./bench-out).
#
#   bash benchmarks/run_all.sh                        # everything, in the order below
#   bash benchmarks/run_all.sh privacy single_13b     # only these
#
# MPS=1 runs them under an NVIDIA MPS control daemon started here (private pipe and log directories, quit
# on exit): client and executor processes then share one GPU context instead of being time-sliced.
# PYTHON=.venv/bin/python picks the interpreter. Names: see ORDER below.
set -u
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/bench-out}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"  # the interpreter that has symbiosis (or PYTHONPATH=src) and its dependencies
mkdir -p "$OUT"
if [[ "${MPS:-0}" == 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/symbiosis-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/symbiosis-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "could not start the MPS control daemon" >&2; exit 1; }
  # quit waits for every MPS client to go; one whose GPU work can never finish would hold it for ever
  trap 'echo quit | timeout 20 nvidia-cuda-mps-control || echo "!! MPS control daemon did not quit" >&2' EXIT
  echo "== MPS control daemon started"
fi

declare -A LIMIT_S=(
  [gpu_tests]=240 [rtt]=90 [single_1b]=150 [single_1b_dora]=200 [single_13b]=330 [multi_1b]=330 [multi_1b_8]=200 [threads_1b_8]=420 [threads_1b_8_both]=480 [threads_1b_8_captured]=330 [anatomy_1b]=300 [anatomy_1b_chunked]=240 [threads_1b_8_chunked]=330 [threads_1b_8_autotuned]=520 [threads_1b_8_all_both]=560 [multi_13b]=420 [multi_1b_ckpt]=240 [multi_13b_ckpt]=570
  [policies]=300 [mixed]=240 [privacy]=320 [long_context]=330
  [engine_tests]=240 [sgmv]=180 [paged_attention]=240 [engine]=560 [hosted_training]=560 [hosted_fleet]=420 [hosted_training_ahead]=300 [hosted_training_profile]=300 [hosted_sdk_processes]=240 [hosted_sdk_fronts]=480
  [serve]=590 [serve_saturation]=590 [serve_fronts]=590 [http_layer]=300 [app_cost]=120 [tenant_fairness]=300 [fine_tuning_jobs]=560 [hmi_tiered]=580 [hmi_on_demand]=580 [hmi_prefetch_large]=560 [hmi_prefetch_one_wave]=560 [hmi_copy_contention]=300 [hmi_prefetch_8b]=580 [placement_store]=60 [host_tier_gc]=180 [plot]=580 [moe_train]=560 [moe_train_captured]=560 [moe_decode]=560
  [gpu_tests_2gpu]=300 [remote_2gpu]=330 [remote_processes_2gpu]=330 [remote_tails_2gpu]=420 [remote_chain_2gpu]=150 [nccl_pair_cost_2gpu]=120 [sharded_13b_2gpu]=560 [processes_13b_2gpu]=480 [processes_13b_2gpu_compiled]=560 [sharded_13b_2gpu_columns]=560 [fsdp_13b_2gpu]=420 [hosted_13b_2gpu]=400 [hosted_13b_replicas]=400
  [sharded_remote_8gpu]=590 [fsdp_27b_8gpu]=590
)
declare -A COMMAND=(
  [gpu_tests]="$PY -m pytest -q -m gpu tests/integration/test_gpu.py tests/unit/client/test_compiled_clients.py -p no:cacheprovider"
  [rtt]="$PY benchmarks/profile_overhead.py --remote"
  [single_1b]="$PY benchmarks/single_tenant.py --models llama-3.2-1b"
  [single_1b_dora]="$PY benchmarks/single_tenant.py --models llama-3.2-1b --loras lora3_r8_qkvo,dora_r8_qkvo --modes plain,in_process,separate"
  [single_13b]="$PY benchmarks/single_tenant.py --models llama-2-13b --loras lora3_r8_qkvo --modes plain,separate"
  [multi_1b]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 1,2,4,8 --duration 8"
  [multi_1b_8]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 8 --duration 5"
  [threads_1b_8]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 8 --duration 5 --clients threads --compile symbiosis"
  [threads_1b_8_captured]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 8 --duration 5 --clients threads --compile symbiosis --capture symbiosis"
  [anatomy_1b]="$PY benchmarks/step_anatomy.py --model llama-3.2-1b"
  [anatomy_1b_chunked]="$PY benchmarks/step_anatomy.py --model llama-3.2-1b --chunked-loss --variants eager,compiled_captured"
  [threads_1b_8_chunked]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 8 --duration 5 --clients threads --compile symbiosis --capture symbiosis --chunked-loss symbiosis"
  [threads_1b_8_autotuned]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 8 --duration 5 --clients threads --compile symbiosis --capture symbiosis --chunked-loss symbiosis --compile-mode max-autotune-no-cudagraphs"
  [threads_1b_8_all_both]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 8 --duration 5 --clients threads --compile both --capture both --chunked-loss both"
  [threads_1b_8_both]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 8 --duration 5 --clients threads --compile both"
  [multi_13b]="$PY benchmarks/multi_tenant.py --model llama-2-13b --tenants 1,2,3 --duration 6"
  [multi_1b_ckpt]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 1,8 --duration 5 --checkpointing"
  [multi_13b_ckpt]="$PY benchmarks/multi_tenant.py --model llama-2-13b --tenants 1,2,8,16 --duration 5 --checkpointing"
  [policies]="$PY benchmarks/policies.py --model llama-3.2-1b --duration 5"
  [mixed]="$PY benchmarks/mixed_work.py --model llama-3.2-1b --duration 5"
  [privacy]="$PY benchmarks/privacy.py --model llama-3.2-1b --duration 5"
  [long_context]="$PY benchmarks/long_context.py --model llama-3-8b --steps 4 --decode-dtypes bfloat16"
  [engine_tests]="$PY -m pytest -q -m gpu tests/unit/engine tests/unit/kernels tests/unit/plot tests/unit/train tests/unit/client/test_experts.py -p no:cacheprovider"
  [sgmv]="$PY benchmarks/sgmv.py"
  [paged_attention]="$PY benchmarks/paged_attention.py"
  [engine]="$PY benchmarks/engine.py --batches 1,8,32,64"
  [hosted_training]="$PY benchmarks/hosted_training.py --model llama-3.2-1b --tenants 8,16,32 --anatomy"
  # tenants' loops that send their next iteration before waiting for the last (the queue then never waits for them)
  # the three targets of hosted training in one call, the fleet beside (run under MPS=1): 32 tenants against the
  # one-job ceiling and against 16 PEFT processes, and one tenant against a compiled PEFT job
  [hosted_fleet]="$PY benchmarks/hosted_training.py --model llama-3.2-1b --tenants 1,32 --fleet 16 --paths engine --duration 8"
  [hosted_training_ahead]="$PY benchmarks/hosted_training.py --model llama-3.2-1b --tenants 32 --duration 10 --fleet= --paths engine,sdk --no-peft --loop ahead --sdk-processes 4"
  [hosted_training_profile]="$PY benchmarks/hosted_training.py --model llama-3.2-1b --tenants 32 --profile $OUT/hosted_training_profile.txt"
  # the SDK's 32 tenants from 4 client processes (client_cpu_share: whether one client interpreter bounded the SDK's runs)
  # (10 s windows: 6 s ones read the SDK path 10-15% lower, a graph capture or two inside the window)
  [hosted_sdk_processes]="$PY benchmarks/hosted_training.py --model llama-3.2-1b --tenants 32 --duration 10 --fleet= --paths engine,sdk --no-peft --sdk-processes 4"
  [hosted_sdk_fronts]="$PY benchmarks/hosted_training.py --model llama-3.2-1b --tenants 32 --duration 10 --fleet= --paths engine,sdk --no-peft --sdk-processes 4 --http-processes 0,1,2"
  # these need the service's dependencies (pyzmq, FastAPI, uvicorn, python-multipart, protobuf, ...; hosted_training
  # also the tinker SDK and its own: h2 for HTTP/2, orjson, pyqwest, rich, zstandard, distro): on a machine without
  # them, install wheels of them first (`pip install --no-index --no-deps --target DIR .whl/*.whl`)
  [serve]="$PY benchmarks/serve.py --model llama-3-8b --adapters 64 --rates 4,16,64 --requests 128"
  # saturation held: ~100-450 requests queued behind the engine's 96 running; a round with requests admitted one at a
  # time, and one 12 at a time (the engine's default: most steps decode-only graph replays): 0.906x and 1.003x HTTP
  # against the engine called directly, the second at twice the tokens/s (2026-11-27, ninth session)
  [serve_saturation]="$PY benchmarks/serve.py --model llama-3-8b --adapters 64 --rates 64 --admit-batch 1,12 --requests 512"
  [app_cost]="$PY benchmarks/app_cost.py --tokens 64 --requests 500"
  [http_layer]="$PY benchmarks/http_layer.py --streams 64 --tokens 128 --step-ms 15 --http-processes 0,1,2 --rounds 2"
  [serve_fronts]="$PY benchmarks/serve.py --model llama-3-8b --adapters 64 --rates 64 --requests 384 --http-processes 0,1 --repeat 3"
  [fine_tuning_jobs]="$PY benchmarks/fine_tuning_jobs.py --model llama-3.2-1b --jobs 8 --rate 8 --requests 128"
  # one tenant's 1,024 sequences against another's one request: alone, admitted by arrival, owners in turns
  [tenant_fairness]="$PY benchmarks/tenant_fairness.py --model llama-3.2-1b --flood 1024 --tokens 100"
  [hmi_tiered]="$PY benchmarks/hmi.py --model llama-3.2-1b --tenants 10000 --clients 250 --requests 12500 --phases hot,tiered"
  # prefetch of 91 MB adapters (r64 on every projection), the pairs' order alternated
  [hmi_prefetch_large]="$PY benchmarks/hmi.py --model llama-3.2-1b --tenants 1000 --distinct 20 --clients 64 --rank 64 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --slots 32 --host-gib 24 --phases placement,prefetch --workdir /tmp/symbiosis-bench-hmi-large"
  # the same with each 91 MB adapter in one wave, not five (the store's placement: 129 against 244 us on an H200,
  # and whole-step waits added less than layer-wise ones in 6 of 8 pairs of runs: PERFORMANCE section 12)
  [hmi_prefetch_one_wave]="$PY benchmarks/hmi.py --model llama-3.2-1b --tenants 1000 --distinct 20 --clients 64 --rank 64 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --slots 32 --host-gib 24 --phases placement,prefetch --wave-bytes 100000000 --workdir /tmp/symbiosis-bench-hmi-large"
  # the same adapters' bytes copied beside a resident adapter's steps, with no placement: what the copy alone adds
  [hmi_copy_contention]="$PY benchmarks/hmi.py --model llama-3.2-1b --tenants 40 --distinct 20 --clients 64 --rank 64 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --slots 32 --host-gib 24 --phases contention --samples 60 --workdir /tmp/symbiosis-bench-hmi-large"
  # the same on Llama-3-8B (335 MB adapters, ~13 ms over PCIe; its 1,024-token prefill has GPU work to hide a copy)
  [hmi_prefetch_8b]="$PY benchmarks/hmi.py --model llama-3-8b --tenants 200 --distinct 6 --clients 16 --samples 24 --rank 64 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --slots 16 --host-gib 24 --phases placement,prefetch --workdir /tmp/symbiosis-bench-hmi-8b"
  # the adapter store alone: a placement's host time at Llama-3.2-1B's layer count (copies waited for, untimed)
  [placement_store]="$PY benchmarks/placement_cpu.py --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --wave-bytes 1000"
  [host_tier_gc]="$PY benchmarks/host_tier_gc.py --adapters 5000"
  [hmi_on_demand]="$PY benchmarks/hmi.py --model llama-3.2-1b --tenants 10000 --clients 250 --requests 12500 --phases on_demand,copies,placement,prefetch"
  [plot]="$PY benchmarks/plot.py --device cuda --model-dir .plotcarry/model --fortunes .plotcarry/fortunes"
  # plot: the model and the fortunes files as scripts/prepare-plot-carry leaves them in .plotcarry (carried alone)
  [moe_train]="$PY benchmarks/multi_tenant.py --model qwen3-30b-a3b-12l --tenants 1,2,4,8 --duration 5 --clients threads"
  # the experts' offsets stay on the device now: a MoE client's step can be compiled and replayed as a CUDA graph
  [moe_train_captured]="$PY benchmarks/multi_tenant.py --model qwen3-30b-a3b-12l --tenants 1,8 --duration 5 --clients threads --compile symbiosis --capture symbiosis --chunked-loss symbiosis"
  # two GPUs (issue: runs on two GPUs), by name only: not in ORDER. Clients on GPU 1 over nccl:// against the same
  # clients in process on GPU 0; the 13B executor sharded over both GPUs, whole layers and columns
  [gpu_tests_2gpu]="$PY -m pytest -q -m gpu tests/unit/executor/test_peers.py tests/unit/executor/test_sharded.py tests/unit/transport/test_collective.py tests/unit/train tests/integration/test_gpu.py -p no:cacheprovider"
  # one remote call's critical path (256 dependent calls of a layer, of an MLP as its layers, of an MLP whole, of
  # o_proj then the MLP, of a decoder tail, in process and over nccl://), and the host's cost of the pair's send and
  # receive with torch's NCCL flight recorder off (the transport's default) and on
  [remote_chain_2gpu]="$PY benchmarks/remote_chain.py --model llama-3.2-1b --client-device cuda:1"
  [nccl_pair_cost_2gpu]="$PY benchmarks/nccl_pair_cost.py"
  # one remote client with decoder tails (nccl:) against MLP blocks alone (nccl-mlps:) and in process, alternated
  [remote_tails_2gpu]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 1 --duration 8 --no-plain --clients threads --executor local --executor nccl-mlps:cuda:0 --executor nccl:cuda:0 --executor local --executor nccl-mlps:cuda:0 --executor nccl:cuda:0 --client-device cuda:1"
  # client threads over nccl:// (and their in-process baseline) with 32 hardware queues a GPU, as the `symbiosis`
  # command sets: at the default 8, four threads hung under MPS twice (2xH200, PERFORMANCE section 14)
  [remote_2gpu]="env CUDA_DEVICE_MAX_CONNECTIONS=32 $PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 1,4,8 --duration 5 --no-plain --clients threads --executor local --executor nccl:cuda:0 --client-device cuda:1"
  # the remote fleet as tenants deploy it, each client a process of its own (its own interpreter), over nccl:// from
  # GPU 1: run beside remote_2gpu, whose in-process fleet is the baseline, under MPS=1 (without it GPU 1 time-slices
  # the clients' contexts: 2xH200, 8 clients 7,576 tokens/s against 14,848 under MPS; PERFORMANCE section 14)
  [remote_processes_2gpu]="$PY benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 1,4,8 --duration 5 --no-plain --clients processes --executor nccl:cuda:0 --client-device cuda:1"
  [sharded_13b_2gpu]="$PY benchmarks/multi_tenant.py --model llama-2-13b --tenants 24 --duration 5 --no-plain --clients threads --checkpointing --executor peers:cuda:0,cuda:1"
  [processes_13b_2gpu]="$PY benchmarks/multi_tenant.py --model llama-2-13b --tenants 20 --duration 5 --no-plain --checkpointing --executor devices:cuda:0,cuda:1"
  [processes_13b_2gpu_compiled]="$PY benchmarks/multi_tenant.py --model llama-2-13b --tenants 20 --duration 5 --no-plain --checkpointing --compile symbiosis --executor devices:cuda:0,cuda:1"
  [sharded_13b_2gpu_columns]="$PY benchmarks/multi_tenant.py --model llama-2-13b --tenants 24 --duration 5 --no-plain --clients threads --checkpointing --executor peers:cuda:0,cuda:1/columns"
  [fsdp_13b_2gpu]="$PY benchmarks/fsdp_fleet.py --model llama-2-13b --jobs 1,2,3 --gpus 2 --duration 10"
  # hosted training of Llama-2-13B LoRA tenants (r8 q/k/v/o, 2 x 512 a step) on two GPUs: the base split over both,
  # a pass pipelined in micro-batches (add --anatomy --tenants 16 for each stage's spans), and a base copy on each GPU
  [hosted_13b_2gpu]="$PY benchmarks/hosted_training.py --model llama-2-13b --seq-len 512 --rank 8 --batch 2 --tenants 24 --devices cuda:0,cuda:1 --max-pass-tokens 16384 --paths engine --fleet= --no-peft --duration 12"
  [hosted_13b_replicas]="$PY benchmarks/hosted_training.py --model llama-2-13b --seq-len 512 --rank 8 --batch 2 --tenants 24 --replicas cuda:0,cuda:1 --max-pass-tokens 4096 --paths engine --fleet= --no-peft --duration 12"
  # eight GPUs, by name only: Gemma-2-27B's executor over GPUs 0-3, 8 clients on GPUs 4-7 over nccl:// (bs 2, seq 64),
  # against FSDP2 + PEFT jobs over all eight
  [sharded_remote_8gpu]="$PY benchmarks/multi_tenant.py --model gemma-2-27b --tenants 8 --duration 5 --seq-len 64 --no-plain --clients threads --executor nccl:sharded:cuda:0,cuda:1,cuda:2,cuda:3 --client-device cuda:4,cuda:5,cuda:6,cuda:7"
  [fsdp_27b_8gpu]="$PY benchmarks/fsdp_fleet.py --model gemma-2-27b --jobs 1,2,4,8 --gpus 8 --seq-len 64"
  [moe_decode]="$PY benchmarks/engine.py --model qwen3-30b-a3b-12l --batches 1,8,32 --patterns none,distinct --peft-batches 8 --compiled-batches ,"
)
ORDER=(gpu_tests rtt single_1b single_1b_dora anatomy_1b anatomy_1b_chunked multi_1b multi_1b_8 threads_1b_8 threads_1b_8_captured
       threads_1b_8_chunked threads_1b_8_autotuned threads_1b_8_all_both threads_1b_8_both multi_1b_ckpt privacy policies mixed long_context single_13b multi_13b
       multi_13b_ckpt engine_tests sgmv paged_attention engine hosted_training hosted_fleet hosted_training_ahead hosted_training_profile hosted_sdk_processes hosted_sdk_fronts serve serve_saturation serve_fronts http_layer app_cost tenant_fairness fine_tuning_jobs hmi_tiered hmi_on_demand hmi_prefetch_large hmi_prefetch_one_wave hmi_copy_contention hmi_prefetch_8b placement_store host_tier_gc
       plot moe_train moe_train_captured moe_decode)

for name in "${@:-${ORDER[@]}}"; do
  if [[ -z "${COMMAND[$name]:-}" ]]; then
    echo "unknown benchmark '$name' (choose from: ${ORDER[*]})" >&2
    exit 2
  fi
  echo "== $name: ${COMMAND[$name]} (limit ${LIMIT_S[$name]} s)"
  start=$SECONDS
  timeout "${LIMIT_S[$name]}" ${COMMAND[$name]} > "$OUT/$name.log" 2>&1
  status=$?
  grep -E '^\{' "$OUT/$name.log" | cut -c1-400
  [[ $status -eq 124 ]] && echo "!! $name cut by its time limit"
  [[ $status -ne 0 && $status -ne 124 ]] && { echo "!! $name failed ($status):"; tail -5 "$OUT/$name.log"; }
  echo "== $name: $((SECONDS - start)) s"
done
