"""Cost of noise masking (docs/PRIVACY.md): masked vs unmasked symbiosis clients, with the plain PEFT
iteration time of the same job as the baseline: 1 and 4 fine-tuning tenants, and decode latency; then the
stronger options (a 4x larger pool; refreshing the pools every 50 calls of a layer) for one tenant.

    python benchmarks/privacy.py --model llama-3.2-1b
"""

from __future__ import annotations

from common import checkpoint, emit, fleet_args, start_executor
from fleet import run_fleet


def main() -> None:
    args = fleet_args(8.0)
    path = checkpoint(args.model)
    trainers = [dict(model_dir=path, name=f"ft{i}") for i in range(4)]
    decoder = dict(model_dir=path, work="decode", batch_size=1, seq_len=128, name="chat")
    plain, _ = run_fleet([dict(trainers[0], mode="plain")], args.duration)
    emit(bench="privacy", model=args.model, setup="plain_peft", iter_s_1_tenant=round(plain[0]["median_s"], 4))
    url = "ipc:///tmp/symbiosis-privacy.sock"
    executor = start_executor(path, url)
    try:
        runs = {}
        for masked in (False, True):
            extra = dict(mode="symbiosis", url=url, privacy_pool=2 if masked else None)
            one, _ = run_fleet([dict(trainers[0], **extra)], args.duration)
            emit(bench="privacy", model=args.model, setup="symbiosis", masked=masked,  # each figure when measured
                 iter_s_1_tenant=round(one[0]["median_s"], 4), build_s=round(one[0]["build_s"], 2))
            four, _ = run_fleet([dict(t, **extra) for t in trainers], args.duration)
            emit(bench="privacy", model=args.model, setup="symbiosis", masked=masked,
                 iter_s_4_tenants=round(max(r["median_s"] for r in four), 4))
            chat, _ = run_fleet([dict(decoder, **extra)], args.duration)
            emit(bench="privacy", model=args.model, setup="symbiosis", masked=masked,
                 decode_ms=round(1e3 * chat[0]["median_s"], 2))
            runs[masked] = (one[0]["median_s"], max(r["median_s"] for r in four), chat[0]["median_s"])
        emit(bench="privacy", model=args.model, setup="masked_over_unmasked",
             **{k: round(runs[True][i] / runs[False][i], 3)
                for i, k in enumerate(("iter_1_tenant", "iter_4_tenants", "decode"))})
        for pool, refresh_every in ((8, 0), (2, 50)):
            one, _ = run_fleet([dict(trainers[0], mode="symbiosis", url=url, privacy_pool=pool,
                                     privacy_refresh_every=refresh_every)], args.duration)
            emit(bench="privacy", model=args.model, setup="symbiosis_stronger", pool=pool,
                 refresh_every=refresh_every, iter_s_1_tenant=round(one[0]["median_s"], 4),
                 build_s=round(one[0]["build_s"], 2), over_unmasked=round(one[0]["median_s"] / runs[False][0], 3))
    finally:
        executor.terminate()
        executor.wait()


if __name__ == "__main__":
    main()
