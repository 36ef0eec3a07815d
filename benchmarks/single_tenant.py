"""Single-tenant overhead (paper Table 2): one LoRA fine-tuning job, plain PEFT vs symbiosis with the client
in-process and in a separate process on the same GPU (ipc://, CUDA IPC buffer).

All modes live in this one process (the separate-process executor in its own) and take their iterations
in turn, so the ratios compare iterations measured side by side, not minutes apart.

    python benchmarks/single_tenant.py --models llama-3.2-1b
    python benchmarks/single_tenant.py --models llama-2-13b --modes plain,separate   # two 13B copies fit
"""

from __future__ import annotations

import argparse
import gc

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import symbiosis
from common import (LORAS, PAPER_LORAS, WARMUP_ITERS, checkpoint, device, dtype, emit, lora, peak_gib, reset_peak, start_executor,
                    time_interleaved)

MODES = {"plain": "plain_peft", "in_process": "symbiosis_in_process", "separate": "symbiosis_separate_process"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama-3.2-1b")
    parser.add_argument("--loras", default=",".join(PAPER_LORAS), help=f"any of {', '.join(LORAS)}")
    parser.add_argument("--modes", default=",".join(MODES), help="which of plain, in_process, separate")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "plain" not in modes or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: plain and any of {list(MODES)[1:]}")
    tokens = args.batch_size * args.seq_len
    url = "ipc:///tmp/symbiosis-bench.sock"

    for model_name in args.models.split(","):
        path = checkpoint(model_name)
        reset_peak()
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype(), device_map=device())
        executor = symbiosis.Executor.from_pretrained(path, device=device(), dtype=dtype()) \
            if "in_process" in modes else None
        process = start_executor(path, url) if "separate" in modes else None
        remote = symbiosis.connect(url, timeout=120) if process else None
        try:
            for lora_name in args.loras.split(","):
                models = {"plain": get_peft_model(base, lora(lora_name))}
                for mode, backend in (("in_process", executor), ("separate", remote)):
                    if backend is not None:
                        models[mode] = get_peft_model(symbiosis.from_pretrained(path, backend, device=device()),
                                                      lora(lora_name))
                remote_session = models["separate"].get_base_model().symbiosis_session if "separate" in models else None
                before = (remote_session.calls, remote_session.waited_s) if remote_session else None
                seconds = time_interleaved(models, args.batch_size, args.seq_len, iters=args.iters)
                for mode, s in seconds.items():
                    record = dict(bench="single_tenant", model=model_name, lora=lora_name, mode=MODES[mode],
                                  batch_size=args.batch_size, seq_len=args.seq_len, device=device(),
                                  s_per_iter=round(s, 5), tokens_per_s=round(tokens / s, 1),
                                  vs_plain_peft=round(s / seconds["plain"], 3))
                    if mode == "separate":  # per iteration (warm-up included): calls, and time waiting on them
                        iters = WARMUP_ITERS + args.iters
                        record.update(calls_per_iter=round((remote_session.calls - before[0]) / iters, 1),
                                      wait_ms_per_iter=round(1e3 * (remote_session.waited_s - before[1]) / iters, 2))
                    emit(**record)
                for mode, model in models.items():
                    if mode != "plain":
                        model.get_base_model().symbiosis_session.close()
                base = models.pop("plain").unload()
                del models
                gc.collect()
            emit(bench="single_tenant_memory", model=model_name, modes=modes,
                 peak_gib_this_process=round(peak_gib(), 2))
            if remote is not None:
                emit(bench="executor_stats", model=model_name, **remote.stats()["overall"])
        finally:
            if process is not None:
                process.terminate()
                process.wait()
        del base, executor
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
