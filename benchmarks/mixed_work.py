"""Mixed work: decode latency of an inference tenant alone vs while 4 tenants fine-tune, for plain PEFT
processes and for symbiosis (inference calls overtake queued training calls at the executor). Also the
cost of noise masking (docs/PRIVACY.md): masked vs unmasked, 1 and 4 fine-tuning tenants, and decode.

    python benchmarks/mixed_work.py --model llama-3.2-1b
"""

from __future__ import annotations

import argparse

from common import checkpoint, emit, start_executor
from fleet import run_fleet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--skip-privacy", action="store_true")
    args = parser.parse_args()
    path = checkpoint(args.model)
    decoder = dict(model_dir=path, work="decode", batch_size=1, seq_len=128, name="chat")
    trainers = [dict(model_dir=path, name=f"ft{i}") for i in range(4)]

    for mode in ("plain", "symbiosis"):
        url = "ipc:///tmp/symbiosis-mixed.sock"
        executor = start_executor(path, url) if mode == "symbiosis" else None
        extra = dict(mode=mode, url=url if executor else None)
        try:
            alone, _ = run_fleet([dict(decoder, **extra)], args.duration)
            loaded, _ = run_fleet([dict(decoder, **extra)] + [dict(t, **extra) for t in trainers], args.duration)
        finally:
            if executor:
                executor.terminate()
                executor.wait()
        emit(bench="mixed_work", model=args.model, mode=mode, decode_ms_alone=round(1e3 * alone[0]["median_s"], 2),
             decode_ms_with_4_finetuning=round(1e3 * loaded[0]["median_s"], 2),
             slowdown=round(loaded[0]["median_s"] / alone[0]["median_s"], 3),
             finetune_tokens_per_s=round(sum(r["tokens_per_s"] for r in loaded[1:])))

    if args.skip_privacy:
        return
    url = "ipc:///tmp/symbiosis-privacy.sock"
    executor = start_executor(path, url)
    try:
        for privacy in (False, True):
            one, _ = run_fleet([dict(trainers[0], mode="symbiosis", url=url, privacy=privacy)], args.duration)
            four, _ = run_fleet([dict(t, mode="symbiosis", url=url, privacy=privacy) for t in trainers], args.duration)
            chat, _ = run_fleet([dict(decoder, mode="symbiosis", url=url, privacy=privacy)], args.duration)
            emit(bench="privacy", model=args.model, masked=privacy, iter_s_1_tenant=round(one[0]["median_s"], 4),
                 iter_s_4_tenants=round(max(r["median_s"] for r in four), 4),
                 tokens_per_s_4_tenants=round(sum(r["tokens_per_s"] for r in four)),
                 decode_ms=round(1e3 * chat[0]["median_s"], 2))
    finally:
        executor.terminate()
        executor.wait()


if __name__ == "__main__":
    main()
