"""Decode attention over the paged KV cache, one layer of Llama-3-8B shape (32 query heads, 8 KV heads, head dim
128, bf16), each call replayed in a CUDA graph, µs per call:

- flex_paged: what the engine runs (engine/attention.py): flex_attention compiled, reading the pool in place
  through the step's block mask (pages per request, each page's owner and index);
- gather_sdpa: the engine's attention before it: every request's context gathered from the pool into a padded
  [R, kv heads, L, d] copy (L a multiple of 256), then one scaled_dot_product_attention with a [R, 1, G, L] mask.

Requests' pages are scattered over the pool (shuffled), as after a while of serving. One JSON line per result:

    PYTHONPATH=src python benchmarks/paged_attention.py
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

from common import emit
from symbiosis.engine import attention
from symbiosis.engine.batch import Chunk, StepBatch

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


class _Request:
    def __init__(self, blocks):
        self.blocks = blocks


def _time(fn, repeats: int = 50) -> float:
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / repeats


def run(batch: int, context: int, block_size: int, rng: random.Random) -> None:
    pages = -(-context // block_size)
    num_pages = batch * pages * 2
    order = list(range(num_pages))
    rng.shuffle(order)
    chunks = [Chunk(_Request(order[r * pages:(r + 1) * pages]), context - 1, [1], None, True) for r in range(batch)]
    step = StepBatch(chunks, block_size, num_pages, pages, torch.device("cuda"))
    slots = (num_pages + 1) * block_size
    keys = torch.randn(KV_HEADS, slots, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kernel = attention._kernel(True, block_size)
    (layout,) = step.layouts
    mask = layout.block_mask(None)
    flex = _time(lambda: kernel(q, keys[None], values[None], mask, None, HEAD_DIM ** -0.5))

    padded = -(-context // 256) * 256
    context_slots = layout.context_slots()[:, :padded]
    context_slots = F.pad(context_slots, (0, padded - context_slots.shape[1]))
    allowed = (torch.arange(padded, device="cuda") < context)[None, None, None, :].expand(batch, 1, HEADS // KV_HEADS, padded)
    grouped = q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)

    def gather_sdpa():
        k = keys[:, context_slots].transpose(0, 1)  # [R, Hkv, L, D]
        v = values[:, context_slots].transpose(0, 1)
        return F.scaled_dot_product_attention(grouped, k, v, attn_mask=allowed)

    reference = _time(gather_sdpa)
    common = dict(bench="paged_attention", batch=batch, context=context, block_size=block_size,
                  gpu=torch.cuda.get_device_name())
    emit(**common, method="flex_paged", us=flex)
    emit(**common, method="gather_sdpa", us=reference, flex_speedup=reference / flex)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--block-sizes", default="16,64")
    args = parser.parse_args()
    rng = random.Random(0)
    for block_size in [int(b) for b in args.block_sizes.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            for context in [int(c) for c in args.contexts.split(",")]:
                run(batch, context, block_size, rng)


if __name__ == "__main__":
    main()
