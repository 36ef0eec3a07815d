"""The torch reference of the SGMV LoRA ops: the oracle every kernel test compares with, and the path taken
on the CPU, in float64, and wherever Triton is not available.

Semantics (the same as the kernels in sgmv.py), for each segment s with tokens t in starts[s]:starts[s+1]:

    v[t]  = x[t] @ A[slots[s]].T                          # shrink: [in] -> [R]
    y[t] += scales[slots[s]] * v[t] @ B[slots[s]].T       # expand: [R] -> [out]

With `slices` (the output widths of G layers that share one input, as q/k/v do), the pools hold the G layers
side by side: A [S, G*R, in] stacked by rank, B [S, sum(slices), R] stacked by output, scales [S, G]; member g
reads v[:, g*R:(g+1)*R] and writes its columns of y with its own scale.

Computed in the inputs' dtype. Tokens outside every segment are untouched (v rows zero).
"""

from __future__ import annotations

import torch

# Per-token gathers of A/B ([T, R, in] / [T, out, R]) are used below this many elements; above it, a loop
# over segments (each segment one matmul pair) avoids materialising a copy of the weights per token.
GATHER_LIMIT = 1 << 22


def token_slots(starts: torch.Tensor, slots: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """slot of each token: int64 [num_tokens], -1 for tokens outside every segment.

    Token t belongs to the last segment s with starts[s] <= t, if t < starts[s+1] (an empty segment never
    holds a token, and no earlier segment can: segments are ordered and disjoint)."""
    n = slots.numel()
    if n == 0:
        return torch.full((num_tokens,), -1, dtype=torch.long, device=starts.device)
    tokens = torch.arange(num_tokens, device=starts.device)                          # [T]
    seg = torch.searchsorted(starts.long(), tokens, right=True) - 1                  # [T] last s with start <= t
    inside = (seg >= 0) & (seg < n)
    seg = seg.clamp(0, n - 1)
    inside &= tokens < starts.long()[seg + 1]
    return torch.where(inside, slots.long()[seg], -1)                                # [T]


def _rank_mask(ranks: torch.Tensor | None, token_slot: torch.Tensor, R: int) -> torch.Tensor | None:
    """[Tc, R] bool: rank column r of a token is used iff r < ranks[slot] (None: every column)."""
    if ranks is None:
        return None
    return torch.arange(R, device=token_slot.device) < ranks.long()[token_slot][:, None]


def _segment_bounds(starts: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(start, end, slot)] of the non-empty segments (host copy: the loop path only)."""
    bounds = starts.tolist()
    return [(s0, s1, slot) for s0, s1, slot in zip(bounds[:-1], bounds[1:], slots.tolist()) if s1 > s0]


def lora_shrink(x: torch.Tensor, a_pool: torch.Tensor, segments, *, ranks: torch.Tensor | None = None) -> torch.Tensor:
    """v [T, R] in x's dtype: v[t] = x[t] @ A[slot(t)].T inside segments, zero outside."""
    T, R = x.shape[0], a_pool.shape[1]
    v = x.new_zeros(T, R)
    slot = token_slots(segments.starts, segments.slots, T)                           # [T]
    covered = (slot >= 0).nonzero().squeeze(1)                                       # [Tc]
    if covered.numel() * R * x.shape[1] <= GATHER_LIMIT:
        a = a_pool[slot[covered]]                                                    # [Tc, R, in]
        v[covered] = torch.einsum("ti,tri->tr", x[covered], a)
    else:
        for s0, s1, s in _segment_bounds(segments.starts, segments.slots):
            v[s0:s1] = x[s0:s1] @ a_pool[s].T                                        # [L, in] @ [in, R]
    mask = _rank_mask(ranks, slot[covered], R)
    if mask is not None:
        v[covered] = v[covered] * mask
    return v


def lora_expand(y: torch.Tensor, v: torch.Tensor, b_pool: torch.Tensor, scales: torch.Tensor, segments,
                *, ranks: torch.Tensor | None = None) -> None:
    """y[t] += scales[slot(t)] * v[t] @ B[slot(t)].T inside segments, in place; rows outside untouched."""
    T, (out, R) = y.shape[0], b_pool.shape[1:]
    slot = token_slots(segments.starts, segments.slots, T)                           # [T]
    covered = (slot >= 0).nonzero().squeeze(1)                                       # [Tc]
    v = v[covered]                                                                   # [Tc, R]
    mask = _rank_mask(ranks, slot[covered], R)
    if mask is not None:
        v = v * mask
    scale = scales[slot[covered]][:, None]                                           # [Tc, 1] float32
    if covered.numel() * R * out <= GATHER_LIMIT:
        b = b_pool[slot[covered]]                                                    # [Tc, out, R]
        y[covered] += scale * torch.einsum("tr,tor->to", v, b)
    else:
        delta = torch.empty(covered.numel(), out, dtype=y.dtype, device=y.device)   # [Tc, out]
        row = 0
        for s0, s1, s in _segment_bounds(segments.starts, segments.slots):
            delta[row:row + s1 - s0] = v[row:row + s1 - s0] @ b_pool[s].T            # [L, R] @ [R, out]
            row += s1 - s0
        y[covered] += scale * delta


def lora_apply(y, x, a_pool, b_pool, scales, segments, *, slices: tuple[int, ...] | None = None,
               ranks: torch.Tensor | None = None) -> None:
    """y += scales[slot] * (x @ A[slot].T) @ B[slot].T for every segment: shrink, then expand (member by member,
    with `slices`; `ranks` go with unsliced calls only)."""
    if slices is None:
        return lora_expand(y, lora_shrink(x, a_pool, segments, ranks=ranks), b_pool, scales, segments, ranks=ranks)
    v = lora_shrink(x, a_pool, segments)
    for member, (offset, width, rank) in enumerate(slice_bounds(slices, b_pool.shape[2])):
        lora_expand(y[:, offset:offset + width], v[:, rank:rank + b_pool.shape[2]],
                    b_pool[:, offset:offset + width], scales[:, member], segments)


def slice_bounds(slices: tuple[int, ...], R: int) -> list[tuple[int, int, int]]:
    """(first output column, width, first rank column) of each member of a fused group."""
    bounds, offset = [], 0
    for member, width in enumerate(slices):
        bounds.append((offset, width, member * R))
        offset += width
    return bounds
