"""Multi-tenant scaling (paper Fig. 10-12) and capacity: N fine-tuning jobs as N plain PEFT processes vs N
symbiosis client processes on one executor process; aggregate tokens/s and GPU memory of everything.

    python benchmarks/multi_tenant.py --model llama-3.2-1b --tenants 1,2,4,8
"""

from __future__ import annotations

import argparse

import torch

import symbiosis
from common import checkpoint, emit, start_executor
from fleet import run_fleet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--tenants", default="1,2,4,8")
    parser.add_argument("--lora", default="lora3_r8_qkvo")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--policy", default="opportunistic")
    args = parser.parse_args()
    path = checkpoint(args.model)
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0
    url = "ipc:///tmp/symbiosis-multi.sock"
    memory: dict[int, tuple[float, float]] = {}  # tenants -> (plain GiB, symbiosis GiB)
    for n in [int(x) for x in args.tenants.split(",")]:
        common = dict(model_dir=path, lora=args.lora, batch_size=2, seq_len=512)
        plain, plain_gib = run_fleet([dict(common, mode="plain", name=f"peft{i}") for i in range(n)], args.duration)
        executor = start_executor(path, url, args.policy)
        try:
            ours, ours_gib = run_fleet([dict(common, mode="symbiosis", url=url, name=f"t{i}") for i in range(n)],
                                       args.duration)
            batching = symbiosis.connect(url, timeout=30).stats()["overall"]  # did calls of clients meet?
        finally:
            executor.terminate()
            executor.wait()
        plain_tps, ours_tps = sum(r["tokens_per_s"] for r in plain), sum(r["tokens_per_s"] for r in ours)
        emit(bench="multi_tenant", model=args.model, tenants=n, policy=args.policy,
             plain_peft_tokens_per_s=round(plain_tps), symbiosis_tokens_per_s=round(ours_tps),
             throughput_ratio=round(ours_tps / plain_tps, 3), plain_peft_gpu_gib=round(plain_gib, 1),
             symbiosis_gpu_gib=round(ours_gib, 1), memory_ratio=round(ours_gib / plain_gib, 3) if plain_gib else None,
             plain_median_iter_s=round(max(r["median_s"] for r in plain), 4),
             symbiosis_median_iter_s=round(max(r["median_s"] for r in ours), 4),
             mean_calls_per_gemm=round(batching["mean_batch_calls"], 3),
             mean_queue_wait_ms=round(batching["mean_queue_wait_ms"], 3))
        memory[n] = (plain_gib, ours_gib)
    largest = max(memory)
    if total_gib and 1 in memory and largest > 1:
        # Capacity from measured footprints: each PEFT job needs its whole footprint; each more symbiosis
        # client adds its own growth, on top of what the executor (and the first client) hold.
        per_job = memory[largest][0] / largest
        per_client = (memory[largest][1] - memory[1][1]) / (largest - 1)
        shared = memory[1][1] - per_client
        peft_fit, ours_fit = int(total_gib // per_job), int((total_gib - shared) // per_client)
        emit(bench="capacity_estimate", model=args.model, gpu_gib=round(total_gib, 1),
             gib_per_peft_job=round(per_job, 2), gib_per_symbiosis_client=round(per_client, 2),
             gib_executor=round(shared, 2), peft_jobs_fit=peft_fit, symbiosis_clients_fit=ours_fit,
             ratio=round(ours_fit / max(1, peft_fit), 2))


if __name__ == "__main__":
    main()
