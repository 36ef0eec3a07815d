"""Long-context decode (paper Fig. 19): tokens/s at 8K-64K context for
  (a) symbiosis: prefill with the client on the GPU, then KV cache to host memory and decode with the client
      on the CPU (the executor keeps the base layers on the GPU);
  (b) plain transformers on the GPU with an offloaded KV cache (DynamicCache(offloading=True));
  (c) plain transformers fully on the GPU.

    python benchmarks/long_context.py --model llama-3-8b --contexts 8192,16384,32768,65536
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import symbiosis
from symbiosis.client.offload import move_client
from common import checkpoint, dtype, emit


@torch.no_grad()
def decode_rate(model, cache, token, steps: int) -> float:
    """Decode `steps` tokens after one warm-up token; tokens/s."""
    times = []
    for i in range(steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return len(times) / sum(times)


@torch.no_grad()
def prefill(model, context: int, cache: DynamicCache, vocab: int, device) -> torch.Tensor:
    ids = torch.randint(0, vocab, (1, context), device=device)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return logits[:, -1:].argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--contexts", default="8192,16384,32768,65536")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--decode-dtypes", default="bfloat16,float32", help="dtypes of the CPU client in (a)")
    args = parser.parse_args()
    path = checkpoint(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    record = dict(bench="long_context", model=args.model, threads=torch.get_num_threads())

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype(), device_map="cuda").eval()
    vocab = plain.config.vocab_size
    for context in contexts:
        for setup, offloading in (("plain_gpu", False), ("plain_gpu_offloaded_cache", True)):
            torch.cuda.empty_cache()
            try:
                cache = DynamicCache(config=plain.config, offloading=offloading)
                token = prefill(plain, context, cache, vocab, "cuda")
                rate = decode_rate(plain, cache, token, args.steps)
                emit(**record, setup=setup, context=context, decode_tokens_per_s=round(rate, 3),
                     gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
            except torch.cuda.OutOfMemoryError:
                emit(**record, setup=setup, context=context, decode_tokens_per_s=None, error="out of GPU memory")
            del cache
            gc.collect()
    del plain
    gc.collect()
    torch.cuda.empty_cache()

    executor = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=dtype())
    for context in contexts:
        for decode_dtype in args.decode_dtypes.split(","):
            model = symbiosis.from_pretrained(path, executor, device="cuda").eval()
            cache = DynamicCache(config=model.config)
            token = prefill(model, context, cache, vocab, "cuda")
            start = time.perf_counter()
            move_client(model, cache, "cpu", getattr(torch, decode_dtype), headroom=args.steps + 1)
            moved_s = time.perf_counter() - start
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            rate = decode_rate(model, cache, token.cpu(), args.steps)
            emit(**record, setup=f"symbiosis_cpu_decode_{decode_dtype}", context=context,
                 decode_tokens_per_s=round(rate, 3), kv_move_s=round(moved_s, 2),
                 gpu_peak_during_decode_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
            model.symbiosis_session.close()
            del model, cache
            gc.collect()


if __name__ == "__main__":
    main()
