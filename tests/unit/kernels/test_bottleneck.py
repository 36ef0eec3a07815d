"""The batched bottleneck op against a loop over tokens (float64 on the CPU; bf16/fp32 on a GPU): segments of
different lengths, tokens outside every segment (requests without an adapter), an empty segment, ranks below the pool's, each
activation, an empty slot."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from symbiosis.kernels.bottleneck import ACTIVATIONS, bottleneck_apply
from symbiosis.kernels.sgmv import Segments


def _pools(slots: int, rank: int, width: int, ranks: list[int], dtype, device):
    torch.manual_seed(0)
    down, down_bias = torch.randn(slots, rank, width, dtype=dtype), torch.randn(slots, rank, dtype=dtype)
    up, up_bias = torch.randn(slots, width, rank, dtype=dtype), torch.randn(slots, width, dtype=dtype)
    for slot, r in enumerate(ranks):  # a rank-r adapter: zeros beyond r, as the store places it
        down[slot, r:], down_bias[slot, r:], up[slot, :, r:] = 0, 0, 0
    scales = torch.tensor([1.0, 0.5, 2.0, 0.0][:slots], dtype=torch.float32)  # slot 3: empty
    acts = torch.tensor([0, 1, 2, 0][:slots], dtype=torch.int32)
    return [t.to(device) for t in (down, down_bias, up, up_bias, scales, acts)]


def _loop(y, pools, bounds, slots):
    down, down_bias, up, up_bias, scales, acts = pools
    act = {0: F.relu, 1: F.gelu, 2: F.silu}
    expected = y.clone()
    for (first, end), slot in zip(bounds, slots):
        for t in range(first, end):
            h = act[int(acts[slot])](y[t] @ down[slot].T + down_bias[slot])
            expected[t] += float(scales[slot]) * (h @ up[slot].T + up_bias[slot])
    return expected


@pytest.mark.parametrize("device, dtype, tolerance", [
    ("cpu", torch.float64, 1e-12),
    pytest.param("cuda", torch.float32, 1e-4, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, 8e-2, marks=pytest.mark.gpu)])
def test_each_segment_gets_its_own_bottleneck(device, dtype, tolerance):
    assert len(ACTIVATIONS) == 3
    pools = _pools(4, 8, 16, [8, 3, 5, 8], dtype, device)
    starts, slots = [1, 4, 4, 11, 12, 14], [0, 1, 1, 2, 3]  # tokens 0 and 14: no adapter; segment 1 empty
    segments = Segments(torch.tensor(starts, dtype=torch.int32, device=device),
                        torch.tensor(slots, dtype=torch.int32, device=device), max_len=7)
    bounds = list(zip(starts[:-1], starts[1:]))
    y = torch.randn(15, 16, dtype=dtype, device=device)
    expected = _loop(y.double().cpu(), [p.double().cpu() if p.is_floating_point() else p.cpu() for p in pools],
                     bounds, slots)
    bottleneck_apply(y, *pools, segments)
    torch.testing.assert_close(y.double().cpu(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(y[0].cpu().double(), expected[0]) and torch.equal(y[14].cpu().double(), expected[14])
