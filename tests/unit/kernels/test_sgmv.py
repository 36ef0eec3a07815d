"""SGMV LoRA ops: the torch reference against a naive per-segment loop (float64, CPU), and the Triton kernels
against the reference (float64 from the same half-precision inputs, GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from symbiosis.kernels import reference, sgmv
from symbiosis.kernels.sgmv import Segments, lora_apply, lora_expand, lora_shrink


def make_adapters(ranks, in_features, out_features, R, dtype=torch.float64, device="cpu", alpha=16.0,
                  rslora=False, pad=0.0):
    """Real adapters [(A [r, in], B [out, r], scale)] and their pools padded to R (pad: the padding's value,
    0 for exact padding; other values check that `ranks` keeps the kernels off the padded part)."""
    adapters = []
    a_pool = torch.full((len(ranks), R, in_features), pad, dtype=dtype, device=device)
    b_pool = torch.full((len(ranks), out_features, R), pad, dtype=dtype, device=device)
    for i, r in enumerate(ranks):
        a = (torch.randn(r, in_features, dtype=torch.float64) / math.sqrt(in_features)).to(dtype).to(device)
        b = (torch.randn(out_features, r, dtype=torch.float64) / math.sqrt(r)).to(dtype).to(device)
        a_pool[i, :r], b_pool[i, :, :r] = a, b
        adapters.append((a, b, alpha / math.sqrt(r) if rslora else alpha / r))
    scales = torch.tensor([s for _, _, s in adapters], dtype=torch.float32, device=device)
    return adapters, a_pool, b_pool, scales


def naive(y, x, adapters, starts, slots):
    """y[s0:s1] += scale * (x[s0:s1] @ A.T) @ B.T, one segment at a time (the adapters unpadded)."""
    y = y.clone()
    for s0, s1, slot in zip(starts[:-1], starts[1:], slots):
        a, b, scale = adapters[slot]
        y[s0:s1] += float(torch.tensor(scale, dtype=torch.float32)) * (x[s0:s1] @ a.T) @ b.T
    return y


def segments(starts, slots, device="cpu") -> Segments:
    lengths = [e - s for s, e in zip(starts[:-1], starts[1:])]
    return Segments(torch.tensor(starts, dtype=torch.int32, device=device),
                    torch.tensor(slots, dtype=torch.int32, device=device), max(lengths, default=0))


# (T, starts, slots): gaps without adapter, empty segments, one segment, shared slots, T=1
LAYOUTS = {
    "mixed_with_gaps": (40, [2, 5, 5, 17, 18, 30, 36], [0, 1, 2, 3, 1, 0]),
    "empty_first_and_last": (12, [0, 0, 4, 9, 9], [3, 1, 2, 0]),
    "one_segment": (9, [0, 9], [2]),
    "shared_slot": (10, [0, 3, 6, 10], [1, 1, 1]),
    "one_token": (1, [0, 1], [3]),
    "decode": (6, [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 2, 1]),
    "no_segments": (5, [0], []),
    "all_empty": (5, [3, 3, 3], [0, 1]),
}


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "segment_loop"])
@pytest.mark.parametrize("rslora", [False, True], ids=["alpha_over_r", "rslora"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reference_matches_naive_loop(layout, rslora, gather, monkeypatch):
    if not gather:
        monkeypatch.setattr(reference, "GATHER_LIMIT", 0)
    T, starts, slots = LAYOUTS[layout]
    adapters, a_pool, b_pool, scales = make_adapters([8, 16, 64, 128], 48, 40, R=128, rslora=rslora)
    x, y0 = torch.randn(T, 48, dtype=torch.float64), torch.randn(T, 40, dtype=torch.float64)
    y = y0.clone()
    lora_apply(y, x, a_pool, b_pool, scales, segments(starts, slots))
    expected = naive(y0, x, adapters, starts, slots)
    assert torch.allclose(y, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())
    covered = torch.zeros(T, dtype=torch.bool)
    for s0, s1 in zip(starts[:-1], starts[1:]):
        covered[s0:s1] = True
    assert torch.equal(y[~covered], y0[~covered])  # untouched rows bit-identical


def make_sliced(slices, R, in_features, num_slots, dtype=torch.float64, device="cpu"):
    """Pools of a fused group: A [S, G*R, in] stacked by rank, B [S, sum(slices), R] stacked by output, scales
    [S, G]."""
    G = len(slices)
    a_pool = (torch.randn(num_slots, G * R, in_features, dtype=torch.float64) / math.sqrt(in_features)).to(dtype)
    b_pool = (torch.randn(num_slots, sum(slices), R, dtype=torch.float64) / math.sqrt(R)).to(dtype)
    scales = torch.rand(num_slots, G, dtype=torch.float32) + 0.5
    return a_pool.to(device), b_pool.to(device), scales.to(device)


def naive_sliced(y, x, a_pool, b_pool, scales, slices, starts, slots):
    """Each member of the group alone, one segment at a time."""
    y, R = y.clone(), b_pool.shape[2]
    for s0, s1, slot in zip(starts[:-1], starts[1:], slots):
        offset = 0
        for g, width in enumerate(slices):
            a, b = a_pool[slot, g * R:(g + 1) * R], b_pool[slot, offset:offset + width]
            y[s0:s1, offset:offset + width] += float(scales[slot, g]) * (x[s0:s1] @ a.T) @ b.T
            offset += width
    return y


@pytest.mark.parametrize("slices", [(40, 24, 24), (56, 56), (40,), (20, 4, 4, 12)], ids=["qkv", "gate_up", "one", "four"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reference_of_a_fused_group_matches_its_members_alone(layout, slices):
    T, starts, slots = LAYOUTS[layout]
    a_pool, b_pool, scales = make_sliced(slices, 8, 48, 4)
    x, y0 = torch.randn(T, 48, dtype=torch.float64), torch.randn(T, sum(slices), dtype=torch.float64)
    y = y0.clone()
    lora_apply(y, x, a_pool, b_pool, scales, segments(starts, slots), slices=slices)
    expected = naive_sliced(y0, x, a_pool, b_pool, scales, slices, starts, slots)
    assert torch.allclose(y, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())


def test_slices_that_do_not_fit_the_pools_are_refused():
    a_pool, b_pool, scales = make_sliced((40, 24, 24), 8, 48, 4)
    x, y = torch.randn(3, 48, dtype=torch.float64), torch.randn(3, 88, dtype=torch.float64)
    for slices in [(40, 24), (40, 24, 20), (88,)]:
        with pytest.raises(ValueError, match="do not fit"):
            lora_apply(y, x, a_pool, b_pool, scales, segments([0, 3], [1]), slices=slices)


def test_shrink_then_expand_is_apply():
    T, starts, slots = LAYOUTS["mixed_with_gaps"]
    adapters, a_pool, b_pool, scales = make_adapters([8, 16, 64, 128], 32, 24, R=128)
    seg = segments(starts, slots)
    x, y0 = torch.randn(T, 32, dtype=torch.float64), torch.randn(T, 24, dtype=torch.float64)
    v = lora_shrink(x, a_pool, seg)
    assert v.shape == (T, 128) and v.dtype == x.dtype
    assert not v[:starts[0]].any() and not v[starts[-1]:].any()  # rows outside segments are zero
    y = y0.clone()
    lora_expand(y, v, b_pool, scales, seg)
    assert torch.allclose(y, naive(y0, x, adapters, starts, slots), rtol=1e-12, atol=1e-12)


def test_ranks_skip_padding():
    """With `ranks`, whatever lies in the padded rows/columns is ignored (here: ones, not zeros)."""
    T, starts, slots = LAYOUTS["mixed_with_gaps"]
    ranks = [8, 16, 64, 128]
    adapters, a_pool, b_pool, scales = make_adapters(ranks, 32, 24, R=128, pad=1.0)
    x, y0 = torch.randn(T, 32, dtype=torch.float64), torch.randn(T, 24, dtype=torch.float64)
    y = y0.clone()
    lora_apply(y, x, a_pool, b_pool, scales, segments(starts, slots), ranks=torch.tensor(ranks, dtype=torch.int32))
    assert torch.allclose(y, naive(y0, x, adapters, starts, slots), rtol=1e-12, atol=1e-12)


def test_token_slots():
    starts, slots = torch.tensor([1, 1, 3, 3, 4], dtype=torch.int32), torch.tensor([7, 8, 9, 5], dtype=torch.int32)
    assert reference.token_slots(starts, slots, 6).tolist() == [-1, 8, 8, 5, -1, -1]


def test_segments_from_lengths():
    seg = Segments.from_lengths([3, 0, 2], [4, 5, 6], start=1)
    assert seg.starts.tolist() == [1, 4, 4, 6] and seg.slots.tolist() == [4, 5, 6] and seg.max_len == 3
    assert seg.starts.dtype == torch.int32 and seg.slots.dtype == torch.int32


def test_plan_covers_inputs():
    """Every split of the shrink starts inside K, and the splits cover K."""
    for n, max_len, K in [(64, 1, 4096), (1, 300, 14336), (3, 7, 1000), (1, 1, 16), (8, 4096, 11008)]:
        plan = sgmv.make_plan(n, max_len, n * max_len, K, 4096, 16, 132)
        assert (plan.split_k - 1) * plan.k_per_split < K <= plan.split_k * plan.k_per_split
        assert plan.k_per_split % plan.block_k == 0 and plan.m_tiles * plan.block_m >= max_len


# ---------------------------------------------------------------------------------------------- GPU

# (token layout, in, out, R): decode batches of distinct adapters, prefill-length segments, non-powers of two
GPU_CASES = [
    ("decode1", 4096, 4096, 16),
    ("decode7", 1024, 1024, 64),
    ("decode64", 4096, 4096, 16),
    ("decode64", 4096, 14336, 16),
    ("decode64", 14336, 4096, 128),
    ("prefill", 4096, 4096, 16),
    ("prefill", 4096, 14336, 64),
    ("prefill", 1024, 1024, 128),
    ("mixed", 4096, 4096, 64),
    ("mixed", 11008, 4096, 16),
]


def gpu_layout(name):
    """(T, starts, slots) with gaps (tokens without adapter) at the ends."""
    if name.startswith("decode"):
        n = int(name[len("decode"):])
        return n + 2, list(range(1, n + 2)), list(range(n))
    if name == "prefill":
        return 302, [1, 301], [0]
    lengths = [300, 0, 1, 1, 45, 1, 17]  # "mixed": prefill and decode in one batch, an empty segment, a shared slot
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return starts[-1] + 3, starts, [0, 1, 2, 3, 4, 5, 2]


def relative_error(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout,in_features,out_features,R", GPU_CASES)
def test_triton_matches_reference(layout, in_features, out_features, R, dtype):
    T, starts, slots = gpu_layout(layout)
    num_slots = max(slots) + 2
    ranks = [(8, 16, 64, 128)[i % 4] if (8, 16, 64, 128)[i % 4] <= R else R for i in range(num_slots)]
    _, a_pool, b_pool, scales = make_adapters(ranks, in_features, out_features, R, dtype=dtype, device="cuda")
    seg = segments(starts, slots, "cuda")
    x = torch.randn(T, in_features, dtype=dtype, device="cuda")
    y0 = torch.randn(T, out_features, dtype=dtype, device="cuda")
    y = y0.clone()
    lora_apply(y, x, a_pool, b_pool, scales, seg)
    expected = y0.double()
    reference.lora_apply(expected, x.double(), a_pool.double(), b_pool.double(), scales, seg)
    covered = reference.token_slots(seg.starts, seg.slots, T) >= 0
    assert torch.equal(y[~covered], y0[~covered])
    assert relative_error(y[covered], expected[covered]) < TOL[dtype]
    delta, expected_delta = y.double() - y0.double(), expected - y0.double()
    assert relative_error(delta[covered], expected_delta[covered]) < 3 * TOL[dtype]
    # the two halves alone
    v = lora_shrink(x, a_pool, seg)
    v_expected = reference.lora_shrink(x.double(), a_pool.double(), seg)
    assert v.dtype == dtype and not v[~covered].any()
    assert relative_error(v, v_expected) < TOL[dtype]
    y2 = y0.clone()
    lora_expand(y2, v, b_pool, scales, seg)
    assert relative_error(y2, y.double()) < TOL[dtype] / 10  # apply == expand(shrink) up to split-K sum order


# (layout, in, member widths, R): Llama-3-8B's q/k/v and gate/up, widths that are no multiple of a tile
GPU_SLICED_CASES = [
    ("decode1", 4096, (4096, 1024, 1024), 16),
    ("decode64", 4096, (4096, 1024, 1024), 16),
    ("decode64", 4096, (14336, 14336), 16),
    ("prefill", 4096, (4096, 1024, 1024), 64),
    ("mixed", 896, (896, 128, 128), 16),
    ("mixed", 1000, (300, 70, 70, 500), 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout,in_features,slices,R", GPU_SLICED_CASES)
def test_triton_fused_group_matches_reference(layout, in_features, slices, R, dtype):
    T, starts, slots = gpu_layout(layout)
    a_pool, b_pool, scales = make_sliced(slices, R, in_features, max(slots) + 2, dtype=dtype, device="cuda")
    seg = segments(starts, slots, "cuda")
    x = torch.randn(T, in_features, dtype=dtype, device="cuda")
    y0 = torch.randn(T, sum(slices), dtype=dtype, device="cuda")
    y = y0.clone()
    lora_apply(y, x, a_pool, b_pool, scales, seg, slices=slices)
    expected = y0.double()
    reference.lora_apply(expected, x.double(), a_pool.double(), b_pool.double(), scales, seg, slices=slices)
    covered = reference.token_slots(seg.starts, seg.slots, T) >= 0
    assert torch.equal(y[~covered], y0[~covered])
    delta, expected_delta = y.double() - y0.double(), expected - y0.double()
    assert relative_error(delta[covered], expected_delta[covered]) < 3 * TOL[dtype]


@pytest.mark.gpu
def test_triton_float32_and_ranks():
    """float32 runs IEEE dots (tight tolerance); `ranks` keeps the kernels off non-zero padding."""
    T, starts, slots = gpu_layout("mixed")
    ranks = [8, 16, 64, 128, 8, 16]
    _, a_pool, b_pool, scales = make_adapters(ranks, 1000, 700, 128, dtype=torch.float32, device="cuda", pad=1.0)
    seg = segments(starts, slots, "cuda")
    x = torch.randn(T, 1000, device="cuda")
    y0 = torch.randn(T, 700, device="cuda")
    y = y0.clone()
    rank_tensor = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    lora_apply(y, x, a_pool, b_pool, scales, seg, ranks=rank_tensor)
    expected = y0.double()
    reference.lora_apply(expected, x.double(), a_pool.double(), b_pool.double(), scales, seg, ranks=rank_tensor)
    assert relative_error(y, expected) < TOL[torch.float32]


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_segments():
    """Capture lora_apply with fixed-size segment tensors, change their contents, replay."""
    n, T, in_features, out_features, R = 8, 24, 4096, 4096, 16
    _, a_pool, b_pool, scales = make_adapters([16] * 12, in_features, out_features, R, dtype=torch.bfloat16,
                                              device="cuda")
    seg = Segments(torch.zeros(n + 1, dtype=torch.int32, device="cuda"),
                   torch.zeros(n, dtype=torch.int32, device="cuda"), max_len=8)
    x = torch.randn(T, in_features, dtype=torch.bfloat16, device="cuda")
    y = torch.zeros(T, out_features, dtype=torch.bfloat16, device="cuda")

    def load(starts, slots):
        seg.starts.copy_(torch.tensor(starts, dtype=torch.int32))
        seg.slots.copy_(torch.tensor(slots, dtype=torch.int32))

    load([0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7])
    lora_apply(y, x, a_pool, b_pool, scales, seg)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_apply(y, x, a_pool, b_pool, scales, seg)
    for starts, slots in [([0, 8, 8, 9, 10, 14, 14, 14, 14], [11, 0, 3, 3, 5, 0, 0, 0]),
                          ([2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 6, 5, 4, 3, 2, 1, 0])]:
        load(starts, slots)
        x.copy_(torch.randn_like(x))
        y0 = torch.randn_like(y)
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        expected = y0.double()
        reference.lora_apply(expected, x.double(), a_pool.double(), b_pool.double(), scales, seg)
        assert relative_error(y, expected) < TOL[torch.bfloat16]
        covered = reference.token_slots(seg.starts, seg.slots, T) >= 0
        assert torch.equal(y[~covered], y0[~covered])


@pytest.mark.gpu
def test_programmatic_dependent_launch_changes_nothing(monkeypatch):
    """lora_apply with the expand launched as a programmatic dependent (Hopper) or plainly: same bits."""
    T, starts, slots = gpu_layout("mixed")
    _, a_pool, b_pool, scales = make_adapters([16] * 6, 4096, 4096, 16, dtype=torch.bfloat16, device="cuda")
    seg = segments(starts, slots, "cuda")
    x = torch.randn(T, 4096, dtype=torch.bfloat16, device="cuda")
    y0 = torch.randn(T, 4096, dtype=torch.bfloat16, device="cuda")
    results = []
    for pdl in (True, False):
        monkeypatch.setattr(sgmv, "PDL", pdl)
        y = y0.clone()
        lora_apply(y, x, a_pool, b_pool, scales, seg)
        results.append(y)
    assert torch.equal(*results)
