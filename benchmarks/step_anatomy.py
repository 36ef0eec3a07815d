"""What one fine-tuning step costs the GPU and the CPU, alone: plain PEFT and a symbiosis client of an
in-process executor, each eager, through torch.compile, captured as a CUDA graph, and both. A fleet of N
tenants on threads of one process is bound by N x the larger of its step's GPU time and CPU time (the
interpreter is shared); N processes by N x the GPU time. All variants live in this one process.

    python benchmarks/step_anatomy.py --model llama-3.2-1b
    python benchmarks/step_anatomy.py --model llama-3.2-1b --chunked-loss   # symbiosis.causal_lm_loss, both sides
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import symbiosis
from common import checkpoint, device, dtype, emit, lora, sync
from tenant import make_step

VARIANTS = {"eager": (False, False), "compiled": (True, False), "captured": (False, True),
            "compiled_captured": (True, True)}


def gpu_ms(step, ids, label: str) -> float:
    """Kernel time of one step (the sum of its kernels' durations, from the profiler); the kernels' table
    goes to $OUT/anatomy_<label>.txt."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(ids)
        sync()
    events = prof.key_averages()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"anatomy_{label}.txt").write_text(events.table(sort_by="cuda_time_total", row_limit=40))
    return sum(e.device_time_total for e in events if e.device_time_total) / 1e3


def measure(model, args, variant: str, label: str) -> dict:
    compiled, captured = VARIANTS[variant]
    options = argparse.Namespace(compile=compiled, capture=captured, batch_size=2, seq_len=512,
                                 chunked_loss=args.chunked_loss, compile_mode=args.compile_mode)
    model.train()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step = make_step(model, options)
    ids = [torch.randint(0, model.config.vocab_size, (2, 512), device=device()) for _ in range(args.iters)]
    for i in range(3):
        step(ids[i])
    sync()
    wall, cpu = [], []
    for x in ids:
        started, started_cpu = time.perf_counter(), time.thread_time()
        step(x)
        cpu.append(time.thread_time() - started_cpu)  # before the wait: what launching the step cost
        sync()
        wall.append(time.perf_counter() - started)
    return dict(s_per_iter=round(statistics.median(wall), 5), cpu_ms_per_iter=round(1e3 * statistics.median(cpu), 2),
                gpu_kernel_ms_per_iter=round(gpu_ms(step, ids[0], label), 2),
                peak_gib_over_model=round((torch.cuda.max_memory_allocated() - before) / 2**30, 2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--lora", default="lora3_r8_qkvo")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--chunked-loss", action="store_true", help="symbiosis.causal_lm_loss on both sides")
    parser.add_argument("--compile-mode", help="torch.compile's mode for the compiled variants")
    args = parser.parse_args()
    path = checkpoint(args.model)
    executor = symbiosis.Executor.from_pretrained(path, device=device(), dtype=dtype(), policy="none")
    builders = {"plain_peft": lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype(), device_map=device()),
                "symbiosis_in_process": lambda: symbiosis.from_pretrained(path, executor, device=device())}
    for variant in args.variants.split(","):
        for mode, build in builders.items():
            model = get_peft_model(build(), lora(args.lora))
            emit(bench="step_anatomy", model=args.model, lora=args.lora, mode=mode, variant=variant,
                 chunked_loss=args.chunked_loss, compile_mode=args.compile_mode,
                 **measure(model, args, variant, f"{mode}_{variant}"))
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
