"""SGMV LoRA microbenchmark (Punica, section 7, Figure 8): one projection's LoRA delta for a decode batch whose
requests use adapters of four popularity patterns, by four methods:

- sgmv: symbiosis.kernels.lora_apply (two Triton launches), eager and captured in a CUDA graph;
- loop: a Python loop over the batch's adapters, two matmuls each (y[s0:s1] += scale * x A^T B^T);
- gather_bmm: gather every token's A and B, then two batched matmuls;
- matmul (Identical only): one plain matmul pair for the single adapter.

Patterns over a batch of n requests: Distinct (n adapters), Uniform (about sqrt(n) adapters, requests
assigned uniformly), Skewed (Zipf alpha 1.5 over n adapters), Identical (one adapter). Requests are grouped
by adapter (the engine sorts tokens by adapter), each group one segment.

Every timed call cycles through ROTATIONS disjoint sets of adapter slots, so that the adapters read (8 x 16 MB
at batch 64) do not stay in the 50 MB L2. One JSON line per result on stdout:

    PYTHONPATH=src python benchmarks/sgmv.py > sgmv.jsonl
    PYTHONPATH=src python benchmarks/sgmv.py --sweep     # block-size variants of the decode-64 kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys

import torch

from common import emit
from symbiosis.kernels import Segments, lora_apply, sgmv

PATTERNS = ("Distinct", "Uniform", "Skewed", "Identical")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ROTATIONS = 8
DTYPE = torch.bfloat16
RESULTS: list[dict] = []


def record(**result) -> None:
    RESULTS.append(result)
    emit(**result)


def adapter_ids(pattern: str, n: int, gen: torch.Generator) -> list[int]:
    """The adapter of each of n requests, sorted (requests grouped by adapter)."""
    if pattern == "Distinct":
        ids = torch.arange(n)
    elif pattern == "Uniform":
        ids = torch.randint(0, max(1, round(math.sqrt(n))), (n,), generator=gen)
    elif pattern == "Skewed":
        zipf = torch.arange(1, n + 1, dtype=torch.float64) ** -1.5
        ids = torch.multinomial(zipf, n, replacement=True, generator=gen)
    else:
        ids = torch.zeros(n, dtype=torch.long)
    return sorted(ids.tolist())


class Batch:
    """One rotation's view of a batch: segments on the GPU, and what the baselines need."""

    def __init__(self, ids: list[int], offset: int, scales: torch.Tensor):
        groups = {}  # adapter -> token count (ids sorted: groups are consecutive)
        for i in ids:
            groups[i] = groups.get(i, 0) + 1
        self.segments = Segments.from_lengths(list(groups.values()), [offset + a for a in groups], device="cuda")
        bounds = self.segments.starts.tolist()
        self.ranges = [(s0, s1, offset + a, scales[offset + a].item())                      # loop: host values
                       for s0, s1, a in zip(bounds[:-1], bounds[1:], groups)]
        self.token_slots = torch.tensor([offset + i for i in ids], device="cuda")            # [T]
        self.token_scales = scales[self.token_slots].to(DTYPE)[:, None]                      # [T, 1]


def methods(x, y, a_pool, b_pool, scales, pattern):
    """name -> fn(batch): each adds the batch's LoRA delta to y."""
    def sgmv_apply(batch):
        lora_apply(y, x, a_pool, b_pool, scales, batch.segments)

    def loop(batch):
        for s0, s1, slot, scale in batch.ranges:
            y[s0:s1].addmm_(x[s0:s1] @ a_pool[slot].T, b_pool[slot].T, alpha=scale)   # [L, R] @ [R, out]

    def gather_bmm(batch):
        a = a_pool[batch.token_slots]                                                     # [T, R, in]
        b = b_pool[batch.token_slots]                                                     # [T, out, R]
        v = torch.bmm(x[:, None, :], a.transpose(1, 2))                                   # [T, 1, R]
        y.add_(torch.bmm(v, b.transpose(1, 2))[:, 0] * batch.token_scales)                # [T, out]

    def matmul(batch):
        (_, _, slot, scale), = batch.ranges
        y.addmm_(x @ a_pool[slot].T, b_pool[slot].T, alpha=scale)

    found = {"sgmv": sgmv_apply, "loop": loop, "gather_bmm": gather_bmm}
    if pattern == "Identical":
        found["matmul"] = matmul
    return found


def median_us(work, calls_per_run: int, repeats: int = 5) -> float:
    """Median µs per call of `work()` (which makes `calls_per_run` calls), timed with CUDA events."""
    runs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / calls_per_run)
    return statistics.median(runs)


def time_eager(fn, batches, iters=200, repeats=5) -> float:
    """Median µs per call of back-to-back calls (launch overhead included)."""
    def calls():
        for i in range(iters):
            fn(batches[i % len(batches)])

    for i in range(10):
        fn(batches[i % len(batches)])
    torch.cuda.synchronize()
    return median_us(calls, iters, repeats)


def time_graph(fn, batches, calls=40, replays=20, repeats=5) -> float:
    """Median µs per call of `calls` calls captured in one CUDA graph (no launch overhead), replayed."""
    fn(batches[0])  # compiled and warm before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(batches[i % len(batches)])
    graph.replay()
    torch.cuda.synchronize()

    def replay():
        for _ in range(replays):
            graph.replay()

    return median_us(replay, replays * calls, repeats)


def pools(in_features, out_features, rank, slots):
    a_pool = torch.randn(slots, rank, in_features, dtype=DTYPE, device="cuda") / math.sqrt(in_features)
    b_pool = torch.randn(slots, out_features, rank, dtype=DTYPE, device="cuda") / math.sqrt(rank)
    scales = torch.full((slots,), 2.0, device="cuda")  # alpha / r with alpha = 2r
    return a_pool, b_pool, scales


def bench_shape(in_features, out_features, rank, patterns, batch_sizes, gpu, check=True):
    max_batch = max(batch_sizes)
    a_pool, b_pool, scales = pools(in_features, out_features, rank, ROTATIONS * max_batch)
    gen = torch.Generator().manual_seed(0)
    shape = f"{in_features}x{out_features}"
    for pattern in patterns:
        for n in batch_sizes:
            ids = adapter_ids(pattern, n, gen)
            batches = [Batch(ids, r * max_batch, scales) for r in range(ROTATIONS)]
            x = torch.randn(n, in_features, dtype=DTYPE, device="cuda")
            y = torch.randn(n, out_features, dtype=DTYPE, device="cuda")
            found = methods(x, y, a_pool, b_pool, scales, pattern)
            if check:  # every method adds the same delta (to bf16 rounding)
                y0 = y.clone()
                deltas = {}
                for name, fn in found.items():
                    y.copy_(y0)
                    fn(batches[0])
                    deltas[name] = (y.float() - y0.float())
                for name, delta in deltas.items():
                    err = ((delta - deltas["loop"]).norm() / deltas["loop"].norm()).item()
                    assert err < 2e-2, (pattern, n, name, err)
            adapters = len(set(ids))
            moved = adapters * rank * (in_features + out_features) * 2 + n * (in_features + 2 * out_features) * 2
            common = dict(bench="sgmv", shape=shape, rank=rank, dtype="bfloat16", pattern=pattern, batch=n,
                          adapters=adapters, min_bytes=moved, gpu=gpu)
            for name, fn in found.items():
                record(**common, method=name, mode="eager", us=round(time_eager(fn, batches), 2))
                record(**common, method=name, mode="graph", us=round(time_graph(fn, batches), 2))


SWEEP = {  # name -> (Plan fields to change, PDL)
    "base": ({}, False),
    "base_pdl": ({}, True),
    "warps4_pdl": ({"shrink_warps": 4, "expand_warps": 4}, True),
    "k64_n128_warps2_pdl": ({"block_k": 64, "k_per_split": 256, "shrink_warps": 2, "block_n": 128,
                             "expand_warps": 2}, True),
    "k128_n512_pdl": ({"block_k": 128, "block_n": 512}, True),
    "k256x1024_n512w8_pdl": ({"k_per_split": 1024, "block_n": 512, "expand_warps": 8}, True),
}


def sweep(gpu):
    """lora_apply at decode 64 (Distinct), graph-timed, under block-size variants (to pick make_plan's)."""
    n = 64
    for K, N in [(4096, 4096), (4096, 14336), (14336, 4096)]:
        R = 16
        a_pool, b_pool, scales = pools(K, N, R, ROTATIONS * n)
        batches = [Batch(list(range(n)), r * n, scales) for r in range(ROTATIONS)]
        x = torch.randn(n, K, dtype=DTYPE, device="cuda")
        y = torch.randn(n, N, dtype=DTYPE, device="cuda")
        base = sgmv.make_plan(n, 1, n, K, N, R, torch.cuda.get_device_properties(0).multi_processor_count)
        record(bench="sgmv_sweep", shape=f"{K}x{N}", variant="plan", plan=str(base), gpu=gpu)
        chosen, pdl_default = sgmv._plan, sgmv.PDL
        for name, (changes, pdl) in SWEEP.items():
            plan = dataclasses.replace(base, **changes)
            plan = dataclasses.replace(plan, split_k=-(-K // plan.k_per_split))
            sgmv._plan, sgmv.PDL = (lambda *args, plan=plan: plan), pdl
            try:
                us = time_graph(lambda b: lora_apply(y, x, a_pool, b_pool, scales, b.segments), batches)
            finally:
                sgmv._plan, sgmv.PDL = chosen, pdl_default
            record(bench="sgmv_sweep", shape=f"{K}x{N}", variant=name, us=round(us, 2), gpu=gpu)
        del a_pool, b_pool


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="only the decode-64 block-size sweep")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    if args.sweep:
        sweep(gpu)
    else:
        bench_shape(4096, 4096, args.rank, PATTERNS, BATCHES, gpu)      # one attention projection of Llama-3-8B
        bench_shape(4096, 14336, args.rank, ("Distinct",), (64,), gpu)  # MLP gate/up
        bench_shape(14336, 4096, args.rank, ("Distinct",), (64,), gpu)  # MLP down
    print_table()


def print_table() -> None:
    """A short table on stderr (stdout holds the JSON lines): µs per shape/pattern/batch, eager|graph."""
    rows: dict[tuple, dict[str, str]] = {}
    for r in RESULTS:
        if r["bench"] == "sgmv":
            cell = rows.setdefault((r["shape"], r["pattern"], r["batch"]), {})
            cell[r["method"]] = f"{cell[r['method']]}|{r['us']}" if r["method"] in cell else str(r["us"])
        else:
            print(" ".join(f"{k}={v}" for k, v in r.items() if k not in ("bench", "gpu")), file=sys.stderr)
    names = ("sgmv", "loop", "gather_bmm", "matmul")
    print("shape pattern batch " + " ".join(f"{n}(eager|graph)" for n in names), file=sys.stderr)
    for (shape, pattern, batch), cell in rows.items():
        print(shape, pattern, batch, *(cell.get(n, "-") for n in names), file=sys.stderr)


if __name__ == "__main__":
    main()
