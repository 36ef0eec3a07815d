"""Batching policies (paper Table 5): mixed tenants (different batch sizes, sequence lengths and paces) under
opportunistic, lockstep and none; plain PEFT processes with the same tenants as the baseline.

    python benchmarks/policies.py --model llama-3.2-1b
"""

from __future__ import annotations

import symbiosis
from common import checkpoint, emit, fleet_args, start_executor
from fleet import run_fleet

# (batch size, sequence length, client-side pause per iteration in ms)
MIXED = [(1, 512, 0), (2, 256, 0), (4, 128, 20), (8, 64, 50)]


def summarize(results: list[dict]) -> dict:
    return {"tokens_per_s": round(sum(r["tokens_per_s"] for r in results)),
            "median_iter_s_per_tenant": [round(r["median_s"], 4) for r in results]}


def main() -> None:
    args = fleet_args()
    path = checkpoint(args.model)
    tenants = [dict(model_dir=path, batch_size=bs, seq_len=sl, pace_ms=pace, name=f"t{i}")
               for i, (bs, sl, pace) in enumerate(MIXED)]
    plain, _ = run_fleet([dict(t, mode="plain") for t in tenants], args.duration)
    emit(bench="policies", model=args.model, setup="plain_peft_processes", tenants=MIXED, **summarize(plain))
    url = "ipc:///tmp/symbiosis-policies.sock"
    for policy in ("opportunistic", "lockstep", "none"):
        executor = start_executor(path, url, policy)
        try:
            ours, _ = run_fleet([dict(t, mode="symbiosis", url=url) for t in tenants], args.duration)
            stats = symbiosis.connect(url, timeout=30).stats()["overall"]
        finally:
            executor.terminate()
            executor.wait()
        emit(bench="policies", model=args.model, setup=f"symbiosis_{policy}", tenants=MIXED, **summarize(ours),
             mean_batch_calls=round(stats["mean_batch_calls"], 2), mean_queue_wait_ms=round(stats["mean_queue_wait_ms"], 3))


if __name__ == "__main__":
    main()
