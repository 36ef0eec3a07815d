"""Where does a split model's extra time go? Per-call overhead of an in-process executor call, and profiles
(Python: cProfile; GPU: torch.profiler) of one fine-tuning iteration, plain PEFT vs symbiosis in-process.

    python benchmarks/profile_overhead.py --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import torch.nn.functional as F
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.client.privacy import MaskedSession
from common import checkpoint, device, dtype, emit, lora, start_executor, sync, train_step


def per_call_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - start) / n * 1e6


def profile(model, label: str, out_dir: str) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    for _ in range(3):
        train_step(model, optimizer, 2, 512, model.config.vocab_size)
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        train_step(model, optimizer, 2, 512, model.config.vocab_size)
    sync()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        train_step(model, optimizer, 2, 512, model.config.vocab_size)
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(os.path.join(out_dir, f"profile_{label}.txt"), "w") as f:
        f.write(text.getvalue() + "\n\n" + table)
    print(f"--- {label}: top python\n" + "\n".join(text.getvalue().splitlines()[:45]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--remote", action="store_true", help="only the per-call latency over ipc://")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    path = checkpoint(args.model)
    executor = symbiosis.Executor.from_pretrained(path, device=device(), dtype=dtype())
    session = executor.attach(executor.fingerprint)
    layer_id = "model.layers.0.self_attn.q_proj"
    weight = executor.weights.layers[layer_id].weight
    x = torch.randn(1024, weight.shape[1], device=device(), dtype=dtype())
    emit(bench="per_call_overhead", raw_linear_us=round(per_call_us(lambda: F.linear(x, weight)), 1),
         session_forward_us=round(per_call_us(lambda: session.forward(layer_id, x)), 1))
    if args.remote:
        url = "ipc:///tmp/symbiosis-profile.sock"
        process = start_executor(path, url)
        try:
            for client_device in ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",):
                remote = symbiosis.connect(url, timeout=60).attach(executor.fingerprint, "probe", torch.device(client_device))
                # The same calls masked (docs/PRIVACY.md): what drawing, adding and subtracting noise adds.
                masked = MaskedSession(remote, symbiosis.NoiseMasking(pool=2), [layer_id], torch.device(client_device),
                                       dtype())
                for tokens in (1, 1024):
                    xs = x[:tokens].to(client_device)
                    emit(bench="per_call_overhead", transport="ipc", client_device=client_device, tokens=tokens,
                         remote_forward_us=round(per_call_us(lambda: remote.forward(layer_id, xs), n=300), 1),
                         masked_forward_us=round(per_call_us(lambda: masked.forward(layer_id, xs), n=300), 1))
                remote.close()
        finally:
            process.terminate()
            process.wait()
        return
    split = get_peft_model(symbiosis.from_pretrained(path, executor, device=device()), lora("lora3_r8_qkvo"))
    profile(split, "symbiosis_in_process", out_dir)
    del split
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype(), device_map=device()),
                           lora("lora3_r8_qkvo"))
    profile(plain, "plain_peft", out_dir)


if __name__ == "__main__":
    main()
