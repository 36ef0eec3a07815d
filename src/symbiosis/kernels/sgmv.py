"""Punica-style SGMV (segmented gather matrix-vector) LoRA kernels: one launch applies many adapters to a
token-flattened batch (Punica, Chen et al. 2023, section 4; ../shared/papers/punica.txt).

The batch is cut into segments, each using one adapter slot of the pools:

    for s in range(n):                       # segments
        t0, t1, i = starts[s], starts[s + 1], slots[s]
        v[t0:t1]  = x[t0:t1] @ A[i].T                       # shrink: a_pool [S, R, in] -> v [T, R]
        y[t0:t1] += scales[i] * v[t0:t1] @ B[i].T           # expand: b_pool [S, out, R]

Adapters of different ranks share a batch: each slot's A (B) is padded to R rows (columns) with zeros, so the
padding adds exact zeros; `ranks` (optional, int32 [S]) lets the kernels skip loading the padded part.

Layers that take one input (q/k/v, gate/up) run as one call with `slices`, their output widths (G of them): the
pools hold them side by side, A [S, G*R, in] stacked by rank, B [S, sum(slices), R] stacked by output, and
scales [S, G]; one shrink makes v [T, G*R], one expand writes every member's columns:

        for g, (o0, o1) in enumerate(member column ranges):
            y[t0:t1, o0:o1] += scales[i, g] * v[t0:t1, g*R:(g+1)*R] @ B[i, o0:o1].T

Dispatch: CUDA tensors of float16/bfloat16/float32 run the Triton kernels below (float32 dots in IEEE
precision); anything else (the CPU, float64, no Triton) runs the torch reference in reference.py. The Triton
grid depends on host values only (the number of segments, `max_len`, the shapes), so calls can be captured
in a CUDA graph and replayed with new segment contents; run each shape once before capturing (compilation).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from symbiosis.kernels import reference

try:  # the kernels need Triton and a GPU; without them every call takes the reference path
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SLICES = 4  # members of one fused call (the expand kernel unrolls over them)
PDL = True
"""lora_apply launches its expand with programmatic dependent launch where the GPU has it (Hopper on): the
expand's programs start while the shrink's last ones run, load their B and y tiles, then wait for the
shrink's partial sums (griddepcontrol.wait), so reading B overlaps reading A."""


@dataclass(frozen=True)
class Segments:
    """A batch of T tokens cut into segments that each use one adapter slot.

    Tokens outside every segment (requests without an adapter) are untouched and cost nothing. Empty
    segments (starts[s] == starts[s+1]) are allowed anywhere (CUDA graphs pad to a fixed n) and are no-ops."""

    starts: torch.Tensor
    """int32 [n+1] on the tokens' device, non-decreasing, starts[0] >= 0, starts[n] <= T: segment s is
    tokens starts[s]:starts[s+1]."""
    slots: torch.Tensor
    """int32 [n]: the adapter slot (row of the pools) of segment s."""
    max_len: int
    """A host-side upper bound on every segment's length (it sizes the grid; longer segments are cut)."""

    @classmethod
    def from_lengths(cls, lengths: list[int], slots: list[int], start: int = 0, device=None) -> Segments:
        """Consecutive segments of the given lengths from token `start` on (host lists -> device tensors)."""
        bounds = [start]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        return cls(torch.tensor(bounds, dtype=torch.int32, device=device),
                   torch.tensor(slots, dtype=torch.int32, device=device), max(lengths, default=0))


def lora_shrink(x: torch.Tensor, a_pool: torch.Tensor, segments: Segments, *,
                ranks: torch.Tensor | None = None) -> torch.Tensor:
    """v [T, R] in x's dtype; rows outside segments are zero.

    Semantics: for each segment s, t in starts[s]:starts[s+1]: v[t] = x[t] @ a_pool[slots[s]].T
    (x [T, in], a_pool [S, R, in]; fp32 accumulation on the Triton path)."""
    _check(x, a_pool.shape[2], a_pool)
    if not _use_triton(x):
        return reference.lora_shrink(x, a_pool, segments, ranks=ranks)
    plan = _plan(segments, x.shape[0], x.shape[1], (1,), a_pool.shape[1], x.device)
    partials = torch.zeros(plan.split_k, x.shape[0], a_pool.shape[1], dtype=torch.float32, device=x.device)
    _launch_shrink(x, a_pool, segments, ranks, partials, plan)
    return partials.sum(0).to(x.dtype)                                               # [T, R]


def lora_expand(y: torch.Tensor, v: torch.Tensor, b_pool: torch.Tensor, scales: torch.Tensor,
                segments: Segments, *, ranks: torch.Tensor | None = None) -> None:
    """In place; rows outside segments are untouched.

    Semantics: for each segment s, i = slots[s], t in starts[s]:starts[s+1]:
        y[t] += scales[i] * v[t] @ b_pool[i].T          (y [T, out], v [T, R], b_pool [S, out, R], scales f32 [S])"""
    _check(y, b_pool.shape[1], b_pool)
    if not _use_triton(y):
        return reference.lora_expand(y, v, b_pool, scales, segments, ranks=ranks)
    plan = _plan(segments, y.shape[0], 1, (y.shape[1],), b_pool.shape[2], y.device)
    _launch_expand(y, v.unsqueeze(0), b_pool, scales, segments, ranks, plan, (y.shape[1],))


def lora_apply(y: torch.Tensor, x: torch.Tensor, a_pool: torch.Tensor, b_pool: torch.Tensor,
               scales: torch.Tensor, segments: Segments, *, slices: tuple[int, ...] | None = None,
               ranks: torch.Tensor | None = None) -> None:
    """y += the LoRA delta of every segment, in place: lora_expand(y, lora_shrink(x, ...), ...).

    Semantics: for each segment s, i = slots[s], t in starts[s]:starts[s+1]:
        y[t] += scales[i] * (x[t] @ a_pool[i].T) @ b_pool[i].T
    With `slices` (G members' output widths; a_pool [S, G*R, in], b_pool [S, sum, R], scales [S, G]) each member
    g adds scales[i, g] * v[t, g*R:(g+1)*R] @ B[i, its columns].T to its columns (see the module's docstring).
    On the Triton path: two launches; the shrink's split-K partial sums (fp32 [split, T, G*R]) are reduced by
    the expand as it loads them, then rounded to x's dtype (as lora_shrink's v is)."""
    _check(x, a_pool.shape[2], a_pool)
    _check(y, b_pool.shape[1], b_pool)
    if slices is not None and (sum(slices) != y.shape[1] or a_pool.shape[1] != len(slices) * b_pool.shape[2]
                               or tuple(scales.shape) != (a_pool.shape[0], len(slices))):
        raise ValueError(f"slices {slices} do not fit pools {tuple(a_pool.shape)}, {tuple(b_pool.shape)}, scales "
                         f"{tuple(scales.shape)} and output {tuple(y.shape)}")
    if slices is not None and ranks is not None:
        raise ValueError("ranks go with unsliced calls only")
    if not _use_triton(x):
        return reference.lora_apply(y, x, a_pool, b_pool, scales, segments, slices=slices, ranks=ranks)
    slices = slices or (y.shape[1],)
    if len(slices) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} layers share one call, not {len(slices)}")
    plan = _plan(segments, x.shape[0], x.shape[1], slices, b_pool.shape[2], x.device)
    partials = torch.empty(plan.split_k, x.shape[0], a_pool.shape[1], dtype=torch.float32, device=x.device)
    pdl = PDL and _has_pdl(x.device)
    _launch_shrink(x, a_pool, segments, ranks, partials, plan, pdl)
    _launch_expand(y, partials, b_pool, scales, segments, ranks, plan, slices, pdl)


def _check(t: torch.Tensor, features: int, pool: torch.Tensor) -> None:
    """Host-side shape/dtype checks only (no device reads: graph capture and no syncs)."""
    if t.dim() != 2 or t.shape[1] != features:
        raise ValueError(f"expected [T, {features}] activations for a pool of shape {tuple(pool.shape)}, "
                         f"got {tuple(t.shape)}")
    if t.dtype != pool.dtype:
        raise ValueError(f"activations are {t.dtype} but the pool is {pool.dtype}")


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and t.dtype in TRITON_DTYPES


# ---------------------------------------------------------------------------------------------- launch plan

@dataclass(frozen=True)
class Plan:
    """Block sizes and grid of one call, from host values only (n, max_len, shapes, the SM count)."""

    block_m: int
    """tokens of one segment per program (tl.dot needs >= 16; a decode segment of 1 token masks the rest)"""
    block_k: int
    """shrink: in-features per loop step"""
    split_k: int
    """shrink: programs splitting the in-features of one token tile (partial sums reduced by the expand)"""
    k_per_split: int
    """shrink: in-features per split (a multiple of block_k)"""
    block_n: int
    """expand: out-features per program"""
    r_block: int
    """shrink: its rank columns (every member's: G*R) rounded up to a power of two >= 16"""
    expand_r_block: int
    """expand: one member's R rounded up likewise"""
    m_tiles: int
    """cdiv(max_len, block_m)"""
    shrink_warps: int = 4
    expand_warps: int = 4


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: compute capability 9.0 (Hopper) and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _plan(segments: Segments, T: int, K: int, slices: tuple[int, ...], R: int, device: torch.device) -> Plan:
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132
    return make_plan(segments.slots.numel(), segments.max_len, T, K, sum(slices), R, sms, len(slices))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)
def make_plan(n: int, max_len: int, T: int, K: int, N: int, R: int, sms: int, members: int = 1) -> Plan:
    """Decode (segments of 1 token, distinct adapters) is bound by reading A and B: enough programs to keep
    every SM loading (split-K for the shrink, whose output is only R wide; out-tiles for the expand).
    Prefill (long segments) has token tiles enough to need little or no split."""
    # The largest token tile that still gives every SM a tile (tl.dot needs >= 16 rows; masked rows cost no
    # loads): a decode segment of 1 token takes 16, one long prefill segment is cut into 16-32 token tiles.
    block_m = 16
    for candidate in (64, 32):
        if candidate < 2 * max_len and n * _cdiv(max_len, candidate) >= sms:
            block_m = candidate
            break
    r_block = max(16, 1 << (members * R - 1).bit_length())
    expand_r_block = max(16, 1 << (R - 1).bit_length())
    m_tiles = max(1, _cdiv(max_len, block_m))
    tiles = min(n * m_tiles, _cdiv(T, block_m) + n)  # token tiles that hold tokens (the rest exit at once)
    # in-features per step: the A tile [r_block, block_k] (and the x tile) of each pipeline stage must fit in
    # shared memory (a fused q/k/v call of rank 64 has r_block 256: 139 KB a stage in float32 at block_k 128)
    block_k = 256 if r_block <= 32 else 128 if r_block <= 128 else 64
    split = max(1, min(_cdiv(4 * sms, tiles), _cdiv(K, block_k)))
    k_per_split = _cdiv(_cdiv(K, split), block_k) * block_k
    split = _cdiv(K, k_per_split)
    block_n = 64
    for candidate in ((256, 128) if expand_r_block <= 32 and block_m <= 32 else (128,)):
        if tiles * _cdiv(N, candidate) >= 2 * sms:
            block_n = candidate
            break
    # Small decode tiles: 2 warps per program (more programs resident; H100, decode 64: 11.1 -> 10.7 µs)
    warps = 2 if block_m == 16 and r_block <= 32 else 4
    expand_warps = 2 if block_m == 16 and expand_r_block <= 32 else 4
    return Plan(block_m, block_k, split, k_per_split, block_n, r_block, expand_r_block, m_tiles, warps, expand_warps)


def _launch_shrink(x, a_pool, segments: Segments, ranks, partials: torch.Tensor, plan: Plan, pdl: bool = False):
    """partials[k, t] = x[t, kK:(k+1)K] @ A[slot(t), :, kK:(k+1)K].T for t in segments (rows outside unwritten)."""
    n = segments.slots.numel()
    if n == 0 or segments.max_len == 0:
        return
    assert partials.shape[0] == plan.split_k
    grid = (plan.split_k, plan.m_tiles, n)
    _shrink_kernel[grid](
        x, a_pool, partials, segments.starts, segments.slots, ranks if ranks is not None else segments.slots,
        x.shape[1], a_pool.shape[1], plan.k_per_split,
        x.stride(0), x.stride(1), a_pool.stride(0), a_pool.stride(1), a_pool.stride(2),
        partials.stride(0), partials.stride(1), partials.stride(2),
        HAS_RANKS=ranks is not None, BLOCK_M=plan.block_m, BLOCK_K=plan.block_k, R_BLOCK=plan.r_block,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SIGNAL_DEPENDENTS=pdl, num_warps=plan.shrink_warps)


def _launch_expand(y, partials, b_pool, scales, segments: Segments, ranks, plan: Plan, slices: tuple[int, ...],
                   pdl: bool = False):
    """y[t, member g's columns] += scales[slot, g] * (sum_k partials[k, t, g's ranks]).to(dtype) @ B[slot, same].T
    for t in segments.

    The grid's first axis runs over every member's column tiles, member after member; a program finds its member
    from the tile counts before it (host values, at most MAX_SLICES - 1 of them).
    pdl: launch as a programmatic dependent of the shrink just launched (which alone writes `partials`:
    everything else the expand reads was written before the shrink started, hence before this launch)."""
    n = segments.slots.numel()
    if n == 0 or segments.max_len == 0:
        return
    tile_starts, column_starts = [0], [0]
    for width in slices:
        tile_starts.append(tile_starts[-1] + triton.cdiv(width, plan.block_n))
        column_starts.append(column_starts[-1] + width)
    padding = [tile_starts[-1]] * (MAX_SLICES - len(slices))  # unused members: never reached
    tiles, columns = tile_starts[1:-1] + padding, column_starts[1:-1] + [column_starts[-1]] * len(padding)
    grid = (tile_starts[-1], plan.m_tiles, n)
    _expand_kernel[grid](
        y, partials, b_pool, scales, segments.starts, segments.slots, ranks if ranks is not None else segments.slots,
        y.shape[1], b_pool.shape[2], partials.shape[0], *tiles, *columns,
        y.stride(0), y.stride(1), partials.stride(0), partials.stride(1), partials.stride(2),
        b_pool.stride(0), b_pool.stride(1), b_pool.stride(2), scales.stride(0),
        scales.stride(1) if scales.dim() == 2 else 0,
        HAS_RANKS=ranks is not None, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        R_BLOCK=plan.expand_r_block, PRECISION="ieee" if y.dtype == torch.float32 else "tf32", WAIT_PRIOR=pdl,
        num_warps=plan.expand_warps, launch_pdl=pdl)


# ---------------------------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _segment_tile(slots_ptr, ranks_ptr, seg, row0, end, R, HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr,
                      R_BLOCK: tl.constexpr):
        """The tile both kernels work on: segment `seg`'s slot, its BLOCK_M token rows from row0 (row_ok: before
        `end`), and the R_BLOCK rank columns that are real (r_ok: below R and, with ranks, below the slot's rank)."""
        slot = tl.load(slots_ptr + seg).to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)                                          # [BM]
        row_ok = rows < end
        rs = tl.arange(0, R_BLOCK)                                                   # [RB]
        r_ok = rs < R
        if HAS_RANKS:
            r_ok = r_ok & (rs < tl.load(ranks_ptr + slot))
        return slot, rows, row_ok, rs, r_ok

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, partial_ptr, starts_ptr, slots_ptr, ranks_ptr,
                       K, R, k_per_split,
                       stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ps, stride_pt, stride_pr,
                       HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       R_BLOCK: tl.constexpr, PRECISION: tl.constexpr, SIGNAL_DEPENDENTS: tl.constexpr):
        """Semantics, for program (k, m, s), i = slots[s], rows = starts[s] + m*BLOCK_M + [0, BLOCK_M) < starts[s+1]:
            partial[k, rows] = x[rows, k*k_per_split : (k+1)*k_per_split] @ A[i, :, same].T   (fp32)"""
        pid_k = tl.program_id(0)
        pid_m = tl.program_id(1)
        seg = tl.program_id(2)
        end = tl.load(starts_ptr + seg + 1)
        row0 = tl.load(starts_ptr + seg) + pid_m * BLOCK_M
        if row0 >= end:  # past this segment's tokens (or an empty segment)
            return
        if SIGNAL_DEPENDENTS:  # a PDL-launched expand may start once every program got here
            tl.extra.cuda.gdc_launch_dependents()
        slot, rows, row_ok, rs, r_ok = _segment_tile(slots_ptr, ranks_ptr, seg, row0, end, R,
                                                     HAS_RANKS, BLOCK_M, R_BLOCK)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt                      # [BM, 1]
        a_rows = a_ptr + slot * stride_as + rs[:, None] * stride_ar                  # [RB, 1]
        acc = tl.zeros([BLOCK_M, R_BLOCK], dtype=tl.float32)
        k0 = pid_k * k_per_split
        for k in range(0, k_per_split, BLOCK_K):
            ks = k0 + k + tl.arange(0, BLOCK_K)                                         # [BK]
            k_ok = ks < K
            xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_rows + ks[None, :] * stride_ak, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)          # [BM, BK] @ [BK, RB]
        out = partial_ptr + pid_k * stride_ps + rows.to(tl.int64)[:, None] * stride_pt + rs[None, :] * stride_pr
        tl.store(out, acc, mask=row_ok[:, None] & (rs < R)[None, :])

    @triton.jit
    def _expand_kernel(y_ptr, partial_ptr, b_ptr, scales_ptr, starts_ptr, slots_ptr, ranks_ptr,
                       N, R, split, tile1, tile2, tile3, col1, col2, col3,
                       stride_yt, stride_yn, stride_ps, stride_pt, stride_pr, stride_bs, stride_bn, stride_br,
                       stride_ss, stride_sg,
                       HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       R_BLOCK: tl.constexpr, PRECISION: tl.constexpr, WAIT_PRIOR: tl.constexpr):
        """Semantics, for program (p, m, s), i = slots[s], rows as in the shrink; p is tile j of member g (g: the
        members whose tiles start at or before p: tile1..3; MAX_SLICES = 4), whose columns are col_g .. col_{g+1} (col_0 = 0,
        col_SLICES = N) and ranks g*R .. g*R + R; cols = col_g + j*BLOCK_N + [0, BLOCK_N) < col_{g+1}:
            v = sum(partial[:, rows, g's ranks], 0).to(B.dtype)       # the shrink's split-K reduction
            y[rows, cols] += scales[i, g] * v @ B[i, cols].T          (fp32 accumulation, one rounding to y)"""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        seg = tl.program_id(2)
        end = tl.load(starts_ptr + seg + 1)
        row0 = tl.load(starts_ptr + seg) + pid_m * BLOCK_M
        if row0 >= end:
            return
        slot, rows, row_ok, rs, r_ok = _segment_tile(slots_ptr, ranks_ptr, seg, row0, end, R,
                                                     HAS_RANKS, BLOCK_M, R_BLOCK)
        # members past the call's own have tiles and columns at the end: never reached
        member = (pid_n >= tile1).to(tl.int32) + (pid_n >= tile2).to(tl.int32) + (pid_n >= tile3).to(tl.int32)
        first_tile = tl.where(member == 0, 0, tl.where(member == 1, tile1, tl.where(member == 2, tile2, tile3)))
        first_col = tl.where(member == 0, 0, tl.where(member == 1, col1, tl.where(member == 2, col2, col3)))
        last_col = tl.where(member == 0, col1, tl.where(member == 1, col2, tl.where(member == 2, col3, N)))
        cols = first_col + (pid_n - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)    # [BN]
        col_ok = cols < last_col
        b = tl.load(b_ptr + slot * stride_bs + cols.to(tl.int64)[:, None] * stride_bn + rs[None, :] * stride_br,
                    mask=col_ok[:, None] & r_ok[None, :], other=0.0)                 # [BN, RB]
        scale = tl.load(scales_ptr + slot * stride_ss + member * stride_sg)
        y_tile = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + cols[None, :] * stride_yn
        y_ok = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_tile, mask=y_ok, other=0.0)
        if WAIT_PRIOR:  # launched while the shrink still runs: wait for its partial sums (and their flush)
            tl.extra.cuda.gdc_wait()
        v_tile = partial_ptr + rows.to(tl.int64)[:, None] * stride_pt + (member * R + rs)[None, :] * stride_pr
        v_ok = row_ok[:, None] & r_ok[None, :]
        v = tl.zeros([BLOCK_M, R_BLOCK], dtype=tl.float32)
        for k in range(split):
            v += tl.load(v_tile + k * stride_ps, mask=v_ok, other=0.0).to(tl.float32)
        delta = tl.dot(v.to(b_ptr.dtype.element_ty), tl.trans(b), input_precision=PRECISION)  # [BM, BN]
        tl.store(y_tile, (y.to(tl.float32) + scale * delta).to(y_ptr.dtype.element_ty), mask=y_ok)


# ---------------------------------------------------------------------------------------------- as an operator

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
OVERLAP_TOKENS = 256


def _base(x, weight, bias, in_out: bool) -> torch.Tensor:
    """x W^T + b (x W + b with `in_out`: transformers' Conv1D keeps W as [in, out])."""
    if in_out:
        return torch.addmm(bias, x, weight) if bias is not None else x @ weight
    return torch.nn.functional.linear(x, weight, bias)


def linear_and_lora_delta(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, in_out: bool,
                          a_pool: torch.Tensor, b_pool: torch.Tensor, scales: torch.Tensor, starts: torch.Tensor,
                          slots: torch.Tensor, max_len: int, slices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W^T + b, delta) where delta [T, out] holds every segment's LoRA, `lora_apply(zeros, x, a_pool, b_pool,
    scales, Segments(starts, slots, max_len), slices=slices)`, and zeros outside the segments; the caller adds them.

    On a GPU the LoRA runs on a side stream beside the base GEMM: the LoRA's small kernels are bound by their
    latency and the GEMM by memory, so the two overlap (H100, Llama-3-8B, batch 8, 8 distinct adapters: a decode
    step 8.09 -> 7.87 ms). Returning the two apart lets compiled code fold the add into the kernel that reads the
    sum next (the norm, the residual add, the MLP's activation) instead of launching it on the step's critical path
    (128 launches a Llama-3-8B decode step)."""
    segments = Segments(starts, slots, max_len)
    # made on the main stream and dropped there after the join: the allocator needs no word of the side stream
    delta = torch.empty(x.shape[0], b_pool.shape[1], dtype=x.dtype, device=x.device)
    if not x.is_cuda:
        delta.zero_()
        lora_apply(delta, x, a_pool, b_pool, scales, segments, slices=tuple(slices))
        return _base(x, weight, bias, in_out), delta
    main = torch.cuda.current_stream(x.device)
    side = _side_streams.get(x.device) or _side_streams.setdefault(x.device, torch.cuda.Stream(x.device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        delta.zero_()
        lora_apply(delta, x, a_pool, b_pool, scales, segments, slices=tuple(slices))
    y = _base(x, weight, bias, in_out)
    main.wait_stream(side)
    return y, delta


def linear_with_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, in_out: bool,
                     a_pool: torch.Tensor, b_pool: torch.Tensor, scales: torch.Tensor, starts: torch.Tensor,
                     slots: torch.Tensor, max_len: int, slices: list[int]) -> torch.Tensor:
    """y = x W^T + b (x W + b with `in_out`), plus every segment's LoRA:
    `lora_apply(y, x, a_pool, b_pool, scales, Segments(starts, slots, max_len), slices=slices)`.

    Decode-sized calls on a GPU (at most OVERLAP_TOKENS tokens) run their LoRA beside the GEMM
    (`linear_and_lora_delta`); larger calls (prefill) add in place after the GEMM: there the delta's extra pass
    over [T, out] costs more than the overlap gains."""
    if not x.is_cuda or x.shape[0] > OVERLAP_TOKENS:
        y = _base(x, weight, bias, in_out)
        lora_apply(y, x, a_pool, b_pool, scales, Segments(starts, slots, max_len), slices=tuple(slices))
        return y
    y, delta = linear_and_lora_delta(x, weight, bias, in_out, a_pool, b_pool, scales, starts, slots, max_len, slices)
    return y.add_(delta)


# As a torch operator, for code that torch.compile traces (compiled decode steps; eager code calls the functions:
# no dispatch): the launch plan is host code, so the compiler keeps the call whole and fuses what lies around it.
linear_and_lora_delta_op = torch.library.custom_op("symbiosis::linear_and_lora_delta",
                                                   mutates_args=())(linear_and_lora_delta)


@linear_and_lora_delta_op.register_fake
def _(x, weight, bias, in_out, a_pool, b_pool, scales, starts, slots, max_len, slices):
    out = b_pool.shape[1]
    return x.new_empty(x.shape[0], out), x.new_empty(x.shape[0], out)

