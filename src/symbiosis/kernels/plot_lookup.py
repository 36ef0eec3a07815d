"""PLOT's lookups and aggregation in one Triton kernel a batch (plot/device.py's torch ops are the reference).

The torch path runs, per fragment length and table, key packing, a `searchsorted`, a gather of [B, S, G, hidden]
values and dense selects, then the aggregation's adds: ~100 kernels for tri-grams over two tables, which made the
looked-up lower layers of a small encoder (MiniLM's three) barely faster than computing them on an H100 (both
bound by launches). Here one program a token does all of it: it packs the fragments that cover (encoder) or end
at (decoder) its token, binary-searches each in the domain's keys, then the root's, and adds the found rows'
values at its position, longest fragments first, in float32.

The tables are packed once: every (table, length) segment's sorted keys one after another (`offsets` [S + 1]:
where each segment's keys start), and their values, [N, length, hidden] each, flattened into one buffer
(`value_offsets` [S]); segment s = table * n + (length - 1), domain first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # the kernel needs Triton and a GPU (or Triton's interpreter); without them plot/device.py's torch path runs
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


@dataclass
class PackedTables:
    keys: torch.Tensor  # int64 [sum N]: each segment's keys, sorted within it
    offsets: torch.Tensor  # int64 [S + 1]
    values: torch.Tensor  # [sum N * length * hidden], the tables' dtype
    value_offsets: torch.Tensor  # int64 [S]
    tables: int
    n: int  # the longest fragment
    steps: int  # binary search steps that cover the largest segment

    @classmethod
    def pack(cls, tables: list[dict[int, tuple[torch.Tensor, torch.Tensor]]], n: int, hidden: int,
             dtype: torch.dtype) -> "PackedTables":
        """`tables`: per table (domain first), length -> (sorted keys [N], values [N, length, hidden])."""
        keys, values, offsets, value_offsets = [], [], [0], []
        value_at, largest = 0, 1
        for table in tables:
            for length in range(1, n + 1):
                table_keys, table_values = table.get(length, (None, None))
                value_offsets.append(value_at)
                if table_keys is not None:
                    keys.append(table_keys)
                    values.append(table_values.reshape(-1).to(dtype))
                    value_at += table_values.numel()
                    largest = max(largest, table_keys.numel())
                offsets.append(offsets[-1] + (0 if table_keys is None else table_keys.numel()))
        device = keys[0].device
        return cls(torch.cat(keys), torch.tensor(offsets, dtype=torch.int64, device=device), torch.cat(values),
                   torch.tensor(value_offsets, dtype=torch.int64, device=device), len(tables), n,
                   steps=largest.bit_length() + 1)


def lookup(kind: str, tokens: torch.Tensor, lengths: torch.Tensor, packed: PackedTables, vocab: int,
           hidden: int) -> torch.Tensor:
    """tokens int64 [B, T] right-padded, lengths int64 [B] -> the lower layers' stand-in, float32 [B, T, hidden]
    (zeros at padding), as plot/device.py's `_encoder` / `_decoder` make it."""
    batch, width = tokens.shape
    out = torch.empty(batch, width, hidden, dtype=torch.float32, device=tokens.device)
    if out.numel():
        _kernel[(batch * width,)](tokens, lengths, packed.keys, packed.offsets, packed.values, packed.value_offsets,
                                  out, width, vocab, hidden, ENCODER=int(kind != "decoder"), N=packed.n,
                                  TABLES=packed.tables, STEPS=packed.steps, BLOCK_H=triton.next_power_of_2(hidden),
                                  num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _find(keys_ptr, offsets_ptr, segment, key, wanted, STEPS: tl.constexpr):
        """(hit, row within the segment) of `key` among segment `segment`'s sorted keys, if `wanted`."""
        first = tl.load(offsets_ptr + segment)
        end = tl.load(offsets_ptr + segment + 1)
        low, high = first, tl.where(wanted, end, first)  # the first key >= `key` lies in [low, high]
        for _ in range(STEPS):
            active = low < high
            middle = (low + high) // 2
            probe = tl.load(keys_ptr + middle, mask=active, other=0)
            right = active & (probe < key)
            left = active & (probe >= key)
            low = tl.where(right, middle + 1, low)
            high = tl.where(left, middle, high)
        inside = wanted & (low < end)
        hit = inside & (tl.load(keys_ptr + low, mask=inside, other=-1) == key)
        return hit, low - first

    @triton.jit
    def _pack(tokens_ptr, row_start, start, length: tl.constexpr, vocab, wanted):
        """The key of the fragment tokens[start:start + length] of a row: first token most significant."""
        key = tl.load(tokens_ptr + row_start + start, mask=wanted, other=0).to(tl.int64)
        for c in tl.static_range(1, length):
            key = key * vocab + tl.load(tokens_ptr + row_start + start + c, mask=wanted, other=0)
        return key

    @triton.jit
    def _look_up(keys_ptr, offsets_ptr, values_ptr, value_offsets_ptr, key, wanted, length: tl.constexpr, position,
                 hidden, columns, N: tl.constexpr, TABLES: tl.constexpr, STEPS: tl.constexpr):
        """(hit, the values at `position` [BLOCK_H] float32) of the fragment `key` of `length` tokens, if `wanted`:
        from the first table (domain, root) that holds it."""
        hit = wanted & (key < 0)  # false (keys are never negative), of the scalar's type
        value = tl.zeros(columns.shape, tl.float32)
        for table in tl.static_range(TABLES):
            segment = table * N + length - 1
            found, found_row = _find(keys_ptr, offsets_ptr, segment, key, wanted & (hit == 0), STEPS)
            at = tl.load(value_offsets_ptr + segment) + (found_row * length + position) * hidden
            value = tl.where(found, tl.load(values_ptr + at + columns, mask=(columns < hidden) & found,
                                            other=0.0).to(tl.float32), value)
            hit = hit | found
        return hit, value

    @triton.jit
    def _fragments(tokens_ptr, keys_ptr, offsets_ptr, values_ptr, value_offsets_ptr, row_start, i, n, open_, columns,
                   vocab, hidden, length: tl.constexpr, ENCODER: tl.constexpr, N: tl.constexpr, TABLES: tl.constexpr,
                   STEPS: tl.constexpr):
        """(the sum of the found values [BLOCK_H], how many were found) of the fragments of `length` tokens that
        cover token i (an encoder's) or end at it (a decoder's, one), if `open_`."""
        acc = tl.zeros(columns.shape, tl.float32)
        count = tl.zeros([], tl.float32)
        for j in tl.static_range(length * ENCODER + 1 - ENCODER):
            position = j * ENCODER + (length - 1) * (1 - ENCODER)  # token i's place in the fragment
            start = i - position
            wanted = open_ & (start >= 0) & (start + length <= n)
            key = _pack(tokens_ptr, row_start, start, length, vocab, wanted)
            hit, value = _look_up(keys_ptr, offsets_ptr, values_ptr, value_offsets_ptr, key, wanted, length,
                                  position, hidden, columns, N, TABLES, STEPS)
            acc += tl.where(hit, value, 0.0)
            count += tl.where(hit, 1.0, 0.0)
        return acc, count

    # a batch's width changes from batch to batch: specialized (on divisibility by 16), it would compile the kernel
    # again for widths not seen yet, mid-service
    @triton.jit(do_not_specialize=["width"])
    def _kernel(tokens_ptr, lengths_ptr, keys_ptr, offsets_ptr, values_ptr, value_offsets_ptr, out_ptr, width, vocab,
                hidden, ENCODER: tl.constexpr, N: tl.constexpr, TABLES: tl.constexpr, STEPS: tl.constexpr,
                BLOCK_H: tl.constexpr):
        # token i, longest fragments first: an encoder's, the mean of its representations in the fragments that
        # cover it (the one starting at i - j holds it at j) of the longest length with any found; a decoder's, the
        # last position of the longest fragment ending at it that a table holds
        program = tl.program_id(0)
        row, i = program // width, program % width
        columns = tl.arange(0, BLOCK_H)
        n = tl.load(lengths_ptr + row)
        open_ = i < n  # padding: zeros
        acc = tl.zeros([BLOCK_H], tl.float32)
        count = tl.zeros([], tl.float32)
        for g in tl.static_range(N):
            part, found = _fragments(tokens_ptr, keys_ptr, offsets_ptr, values_ptr, value_offsets_ptr, row * width,
                                     i, n, open_, columns, vocab, hidden, N - g, ENCODER, N, TABLES, STEPS)
            acc += part
            count += found
            open_ = open_ & (count == 0)
        acc = tl.where(count > 0, acc / tl.maximum(count, 1.0), 0.0)
        tl.store(out_ptr + program.to(tl.int64) * hidden + columns, acc, mask=columns < hidden)
