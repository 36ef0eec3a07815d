"""Bottleneck (Houlsby) adapters of many tenants in one batch (HMI §3.2.2 eq. 1, §6).

For each segment s of the token-flattened batch (Segments, as the SGMV kernels cut it), with i = slots[s]:

    for t in starts[s]:starts[s+1]:
        y[t] += scales[i] * (act_i(y[t] @ Wd[i].T + bd[i]) @ Wu[i].T + bu[i])

    pools: Wd [S, R, D], bd [S, R], Wu [S, D, R], bu [S, D], scales float32 [S], acts int [S] (ACTIVATIONS)

the adapter added to the layer's own output y (before the residual add, where Houlsby places it). As HMI batches
tenants' adapters: the segments are padded to one length L (`max_len`, a host value) and stacked, so each projection
is one torch.baddbmm over every segment, whatever adapter it uses: [n, L, D] x [n, D, R] then [n, L, R] x [n, R, D].
A rank-r adapter fills rows :r of its slot (zeros beyond: act(0) = 0 for each activation here, so the padding adds
exact zeros); an empty slot has scale 0. Nothing here reads a device value on the host: it can be compiled and
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from symbiosis.kernels.sgmv import Segments

ACTIVATIONS = ("relu", "gelu", "silu")  # an adapter's act is its index here


def activation(h: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """Each row's own activation: `act` holds ACTIVATIONS indices, broadcast against h."""
    return torch.where(act == 0, F.relu(h), torch.where(act == 1, F.gelu(h), F.silu(h)))


def bottleneck_apply(y: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, up: torch.Tensor,
                     up_bias: torch.Tensor, scales: torch.Tensor, acts: torch.Tensor, segments: Segments) -> None:
    """y [T, D] += each segment's adapter of its own output, in place (see the module's docstring)."""
    n, longest = segments.slots.numel(), segments.max_len
    if n == 0 or longest == 0 or y.shape[0] == 0:
        return
    starts, slots = segments.starts.long(), segments.slots.long()
    index = starts[:-1, None] + torch.arange(longest, device=y.device)              # [n, L] token of each place
    valid = (index < starts[1:, None]).unsqueeze(-1)                                  # [n, L, 1]
    index = index.clamp(max=y.shape[0] - 1)
    x = y[index] * valid                                                              # [n, L, D]
    h = torch.baddbmm(down_bias[slots].unsqueeze(1), x, down[slots].transpose(1, 2))  # [n, L, R]
    h = activation(h, acts[slots].view(n, 1, 1))
    out = torch.baddbmm(up_bias[slots].unsqueeze(1), h, up[slots].transpose(1, 2))    # [n, L, D]
    out = out * (scales[slots].view(n, 1, 1).to(out.dtype) * valid)                   # padding and empty slots: 0
    y.index_add_(0, index.flatten(), out.flatten(0, 1))
