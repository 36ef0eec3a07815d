"""One benchmark tenant process (launched by multi_tenant.py and friends; not run by hand).

Builds its model (plain PEFT, or a symbiosis client of the executor at --url), warms up, prints
{"ready": true}, waits for --go-file, then works for --duration seconds and prints one JSON result:
fine-tuning (--work train) or greedy decoding one token at a time (--work decode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import symbiosis
from common import device, dtype, lora, peak_gib, sync, train_step


def build(args):
    if args.mode == "plain":
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype(), device_map=device())
    else:
        privacy = symbiosis.NoiseMasking(pool=args.privacy_pool, rows=1024, refresh_every=args.privacy_refresh_every) \
            if args.privacy_pool else None
        model = symbiosis.from_pretrained(args.model_dir, symbiosis.connect(args.url, timeout=300), device=device(),
                                          name=args.name, privacy=privacy)
    model = get_peft_model(model, lora(args.lora))
    if args.checkpointing:  # backward recomputes each decoder layer's forward (on a split model: its calls too)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def train_loop(model, args, until: float | None, max_iters: int | None = None) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    times = []
    while (until is None or time.time() < until) and (max_iters is None or len(times) < max_iters):
        start = time.perf_counter()
        train_step(model, optimizer, args.batch_size, args.seq_len, model.config.vocab_size)
        sync()
        times.append(time.perf_counter() - start)
        if args.pace_ms:
            time.sleep(args.pace_ms / 1e3)
    return times


@torch.no_grad()
def decode_loop(model, args, until: float | None, max_iters: int | None = None) -> list[float]:
    """Per-token latency of greedy decoding with a KV cache, restarting from a fresh prompt every 64 tokens."""
    model.eval()
    times = []
    while (until is None or time.time() < until) and (max_iters is None or len(times) < max_iters):
        ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), device=model.device)
        out = model(input_ids=ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(64):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - start)
            if until is not None and time.time() >= until:
                break
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "symbiosis"], required=True)
    parser.add_argument("--work", choices=["train", "decode"], default="train")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--url")
    parser.add_argument("--name", default="tenant")
    parser.add_argument("--lora", default="lora3_r8_qkvo")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pace-ms", type=float, default=0.0, help="client-side pause between iterations")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--go-file", required=True)
    parser.add_argument("--privacy-pool", type=int, default=0, help="NoiseMasking pool size (0: no masking)")
    parser.add_argument("--privacy-refresh-every", type=int, default=0)
    parser.add_argument("--checkpointing", action="store_true", help="transformers' gradient checkpointing")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(hash(args.name) % 1000)
    started = time.perf_counter()
    model = build(args)
    build_s = time.perf_counter() - started  # attach, load, and (masked) computing the noise pools
    loop = train_loop if args.work == "train" else decode_loop
    loop(model, args, until=None, max_iters=3)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    while not os.path.exists(args.go_file):
        time.sleep(0.01)
    session = getattr(model.get_base_model(), "symbiosis_session", None)
    calls, waited = (session.calls, session.waited_s) if session is not None else (0, 0.0)
    times = loop(model, args, until=time.time() + args.duration)
    tokens = args.batch_size * (args.seq_len if args.work == "train" else 1)
    result = {"name": args.name, "iters": len(times), "median_s": statistics.median(times),
              "tokens_per_s": tokens * len(times) / sum(times) if times else 0.0,
              "wall_tokens_per_s": tokens * len(times) / args.duration,
              "peak_gib": peak_gib(), "build_s": build_s}
    if session is not None:  # the share of the working time this client spent waiting for the executor
        result.update(calls_per_iter=(session.calls - calls) / max(1, len(times)),
                      wait_share=(session.waited_s - waited) / sum(times) if times else 0.0)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
