"""Mixed work: decode latency of an inference tenant alone vs while 4 tenants fine-tune, for plain PEFT
processes and for symbiosis (inference calls overtake queued training calls at the executor).

    python benchmarks/mixed_work.py --model llama-3.2-1b
"""

from __future__ import annotations

from common import checkpoint, emit, fleet_args, start_executor
from fleet import run_fleet


def main() -> None:
    args = fleet_args()
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



if __name__ == "__main__":
    main()
