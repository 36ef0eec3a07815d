"""One engine step's batch, built once per step and read by every layer.

The step runs the tokens of several requests as one flat sequence of T tokens (batch dimension 1): each
scheduled request contributes a *chunk*, its tokens `start .. start + length - 1` (a whole decode step is one
token; a prefill is cut into chunks under the step's token budget). Chunks are laid out grouped by adapter slot, so
that each adapter's tokens are one contiguous segment for the SGMV kernels; requests without an adapter come
last and are in no segment.

Attention reads the KV pool in place (engine/attention.py) in one call per *layout* (`AttentionLayout`): rows
of queries, each row the queries of one chunk, with, per row, which pool blocks (pages) its queries read, as a
flex_attention block mask over the pool, and, per page, whose it is and which of its owner's pages it is, so that
each key's position in its request is known without a gathered copy. A step's one-token chunks (decodes) are one
layout of one query per row; its longer chunks (prefills) another, cut into rows of QUERY_BLOCK queries. Both are
padded to a power of two of rows, so the compiled kernels (static in their shapes) meet a few shapes: rows buckets
alone, never (rows, longest prompt) pairs (H100, the serve benchmark: 56 prefill compilations over 4 minutes of
Poisson traffic with the earlier (rows, queries) buckets).

Shapes (T tokens, K = rows sampled, N = pool pages + 1 (the trash page)):
    input_ids, positions, slots   [T]              token, its position in its request, its flat KV slot
    previous_rows                 [T]              -1, or the row of the step before's sampled tokens that holds this
                                                   token (it was not read back yet: input_ids holds 0 there)
    page_owner, page_index         [N]              chunk that owns each page (-1: none), its index in that
                                                    chunk's block table
    sample_rows                    [K]              the flat rows whose logits are sampled (a chunk's last token,
                                                    when it reaches the end of what the request has so far)
and per layout of R rows of Q queries (P = max_pages): see `AttentionLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from symbiosis.kernels.sgmv import Segments

QUERY_BLOCK = 128  # a prefill layout's queries per row: one block-mask row (flex_attention's default sparse block)


def bucket(count: int) -> int:
    """`count` rounded up to a power of two: the few shapes that compiled code and recorded graphs are made for."""
    return 1 << (count - 1).bit_length()


@dataclass
class Chunk:
    request: object  # engine.scheduler.Request
    start: int
    tokens: list[int]
    slot: int | None  # adapter slot, None: the base model alone
    sample: bool
    from_row: int | None = None  # the last token is still on the device: that row of the step before's samples


def _runs(slots: list[int | None], lengths: list[int]) -> list[tuple[int, int, int]]:
    """(first row, end row, slot) of each run of rows of one adapter slot, over rows laid out in `slots` order
    (None: no adapter). Chunks are sorted with the adapter-less ones last, so the runs are contiguous from row 0."""
    runs, offset = [], 0
    for slot, length in zip(slots, lengths):
        if slot is not None and length:
            if runs and runs[-1][2] == slot:
                runs[-1] = (runs[-1][0], offset + length, slot)
            else:
                runs.append((offset, offset + length, slot))
        offset += length
    return runs


def _segment_arrays(runs: list[tuple[int, int, int]], pad_to: int = 0) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Segments (starts int32 [n+1], slots int32 [n], max_len) of contiguous runs from row 0, padded with empty
    segments to `pad_to`; None without runs."""
    if not runs:
        return None
    count = max(len(runs), pad_to)
    starts = np.full(count + 1, runs[-1][1], dtype=np.int32)
    starts[:len(runs)] = [first for first, _, _ in runs]
    slots = np.zeros(count, dtype=np.int32)
    slots[:len(runs)] = [slot for _, _, slot in runs]
    return starts, slots, max(end - first for first, end, _ in runs)


class Staging:
    """Pinned host memory that each step's index arrays go to the device from, reused round a ring. A fresh
    `pin_memory()` of each step's arrays cost ~0.75 ms of the engine thread a call on the H100 (run 69's profile,
    two a step). A buffer is written again once the copy queued from it `len(ring)` uploads before is done: the engine
    waits for each step's tokens within two steps, so that wait is over long before."""

    def __init__(self, slots: int = 8):
        self._ring: list[tuple[torch.Tensor, torch.cuda.Event] | None] = [None] * slots
        self._next = 0

    def upload(self, data: np.ndarray, device: torch.device) -> torch.Tensor:
        """`data` (uint8) on `device`, queued on the current stream."""
        slot, self._next = self._next, (self._next + 1) % len(self._ring)
        held = self._ring[slot]
        if held is not None:
            held[1].synchronize()
        if held is None or held[0].numel() < data.nbytes:
            held = (torch.empty(max(2 * data.nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True),
                    torch.cuda.Event())
        staged = held[0][:data.nbytes]
        staged.numpy()[:] = data
        on_device = staged.to(device, non_blocking=True)
        held[1].record()
        self._ring[slot] = held
        return on_device


def _upload(arrays: dict[str, object], device: torch.device, staging: Staging | None) -> dict[str, torch.Tensor]:
    """Host arrays (numpy int32 / int64, or lists of ints: int64) as device tensors of their shapes, in one copy (on
    a GPU from `staging`'s pinned memory, not waiting for the device)."""
    arrays = {name: np.ascontiguousarray(a, dtype=np.int64 if not isinstance(a, np.ndarray) else a.dtype)
              for name, a in arrays.items()}
    assert all(a.dtype in (np.int32, np.int64) for a in arrays.values())
    # the int64 arrays first, so that every array's bytes start at a multiple of its item size
    names = sorted(arrays, key=lambda name: arrays[name].dtype != np.int64)
    data = np.concatenate([arrays[name].reshape(-1).view(np.uint8) for name in names])
    if device.type == "cuda" and staging is not None:
        flat = staging.upload(data, device)
    else:
        flat = torch.from_numpy(data).to(device)
    tensors, offset = {}, 0
    for name in names:
        array = arrays[name]
        tensors[name] = flat[offset:offset + array.nbytes].view(torch.from_numpy(array[:0]).dtype).view(array.shape)
        offset += array.nbytes
    return tensors


class AttentionLayout:
    """One attention call over the pool: R rows of Q queries, row r the queries of one chunk (a decode's token, or
    up to QUERY_BLOCK consecutive queries of a prefill chunk), padding rows and queries reading no page and never
    gathered back.

        query_index, query_positions  [R, Q]          flat token of row r's q-th query, its position (padding: 0)
        tokens, query_rows            [n]             the flat tokens the layout computes, and the row r * Q + q of
                                                      each in the padded queries
        row_chunk                     [R]             the chunk (index in the step) of each row (padding: -2)
        kv_num_blocks                 [R, 1, 1]       how many pages row r's queries read (up to its last query) ...
        kv_indices                    [R, 1, 1, P]    ... and which: the first pages of its chunk's block table

    `one_token_rows` (a padded decode step, engine/graphs.py): row r is flat token r, for every token: no gather."""

    TENSORS = ("query_index", "query_positions", "tokens", "query_rows", "row_chunk", "kv_num_blocks", "kv_indices")

    def __init__(self, name: str, tensors: dict[str, torch.Tensor], longest_pages: int, one_token_rows: bool,
                 whole: bool, block_size: int):
        for field in self.TENSORS:
            setattr(self, field, tensors[f"{name}_{field}"])
        # the step's page tables (its tensors, updated in place by StepBatch.copy_from), not the step itself: a
        # layout held by its step and holding it back would leave every step's tensors to the cyclic collector
        self.page_owner, self.page_index, self.block_size = tensors["page_owner"], tensors["page_index"], block_size
        self.longest_pages, self.one_token_rows = longest_pages, one_token_rows
        self.whole = whole  # it computes every flat token, in flat order: its output needs no scatter
        self._block_masks: dict[int | None, object] = {}
        # the CPU's masks, made once a step for all its layers: (context_slots, which of them each query sees), and
        # which pool slots each query sees (the in-place path's, as the tests run it on the CPU)
        self._gathered: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool_visible: dict[int | None, torch.Tensor] = {}

    @staticmethod
    def arrays(name: str, rows: list[tuple[int, int, int, int]], tables: list, queries: int, padded_rows: int,
               block_size: int, num_pages: int, max_pages: int) -> tuple[dict[str, np.ndarray], int]:
        """Host arrays of a layout of `rows` (chunk, flat first token, first position, queries) padded to
        `padded_rows`, `queries` per row (chunk -2: a padding token's, reading no page); `tables`: each chunk's block
        table. Returns (arrays, longest_pages)."""
        count = max(len(rows), padded_rows)
        query_index = np.zeros((count, queries), dtype=np.int64)
        query_positions = np.zeros((count, queries), dtype=np.int64)
        row_chunk = np.full(count, -2, dtype=np.int32)
        kv_num_blocks = np.zeros((count, 1, 1), dtype=np.int32)
        kv_indices = np.full((count, 1, 1, max_pages), num_pages, dtype=np.int32)  # padding: the trash page
        tokens, query_rows, longest_pages = [], [], 0
        for row, (chunk, first, start, length) in enumerate(rows):
            pages = 0 if chunk < 0 else -(-(start + length) // block_size)  # chunk < 0: a padding token's row
            query_index[row, :length] = np.arange(first, first + length)
            query_positions[row, :length] = np.arange(start, start + length)
            row_chunk[row] = chunk
            kv_num_blocks[row, 0, 0] = pages
            if pages:
                kv_indices[row, 0, 0, :pages] = tables[chunk][:pages]
            tokens += range(first, first + length)
            query_rows += range(row * queries, row * queries + length)
            longest_pages = max(longest_pages, pages)
        return {f"{name}_query_index": query_index, f"{name}_query_positions": query_positions,
                f"{name}_tokens": tokens, f"{name}_query_rows": query_rows, f"{name}_row_chunk": row_chunk,
                f"{name}_kv_num_blocks": kv_num_blocks, f"{name}_kv_indices": kv_indices}, longest_pages

    def copy_from(self, other: "AttentionLayout") -> None:
        for field in self.TENSORS:
            getattr(self, field).copy_(getattr(other, field))
        self.longest_pages = other.longest_pages  # read on the host (context_slots)
        self._gathered.clear()  # made from the values copied over (block masks read the tensors themselves)
        self._pool_visible.clear()

    def block_mask(self, sliding_window: int | None):
        """flex_attention's BlockMask over the whole KV pool ([pages * block_size] keys, page = block): query q of
        row r reads the key at pool slot k when k's page is r's chunk's and k's position in that chunk's request is
        visible from q's. The pages listed per row make the GPU's kernels skip every other page."""
        if sliding_window not in self._block_masks:
            from torch.nn.attention.flex_attention import BlockMask

            row_chunk, query_positions = self.row_chunk, self.query_positions
            owner, index, size = self.page_owner, self.page_index, self.block_size

            def visible(b, h, q, k):
                page = k // size
                return (owner[page] == row_chunk[b]) & _visible(index[page] * size + k % size, query_positions[b, q],
                                                               sliding_window)

            self._block_masks[sliding_window] = BlockMask.from_kv_blocks(
                self.kv_num_blocks, self.kv_indices, BLOCK_SIZE=(QUERY_BLOCK, size), mask_mod=visible,
                seq_lengths=(self.query_index.shape[1], owner.shape[0] * size), compute_q_blocks=False)
        return self._block_masks[sliding_window]

    def gathered(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(`context_slots()` [R, L], which of them each query sees [R, 1, Q, L]), made once a step for all its
        layers: the CPU's attention over gathered contexts. (Key k of row r is its request's position k: the mask
        is one broadcast comparison. flex_attention's mask helpers vmap a mask_mod instead, which left ~3,500
        objects in reference cycles a step on the tiny model, for the cyclic collector.)"""
        if sliding_window not in self._gathered:
            context = self.context_slots()
            positions = torch.arange(context.shape[1], device=context.device)
            self._gathered[sliding_window] = context, _visible(positions, self.query_positions[:, None, :, None],
                                                               sliding_window)
        return self._gathered[sliding_window]

    def pool_visible(self, sliding_window: int | None) -> torch.Tensor:
        """[R, 1, Q, pool slots]: which slots of the pool each query sees (`block_mask`'s mask_mod, evaluated), made
        once a step: the in-place path's mask on the CPU, where the tests run it."""
        if sliding_window not in self._pool_visible:
            from torch.nn.attention.flex_attention import create_mask

            rows, queries = self.query_positions.shape
            self._pool_visible[sliding_window] = create_mask(
                self.block_mask(sliding_window).mask_mod, rows, None, queries, self.page_owner.shape[0] * self.block_size,
                device=self.query_positions.device)
        return self._pool_visible[sliding_window]

    def context_slots(self) -> torch.Tensor:
        """[R, longest_pages * block_size]: the pool slot of each row's context position (the positions of pages
        it does not read: slots of the trash page), for attention over gathered contexts (the CPU's)."""
        size = self.block_size
        pages = self.kv_indices[:, 0, 0, :self.longest_pages].long()
        return (pages[:, :, None] * size + torch.arange(size, device=pages.device)).flatten(1)


class StepBatch:
    """`padded_rows`, for a decode step replayed from a CUDA graph (engine/graphs.py): every shape is fixed by the
    row count and nothing else: the chunks (one token each) are followed by padding rows (token 0 at position 0,
    written to the KV cache's trash slot, reading no page: their attention output is zero, their logits are
    never read), and the SGMV segments are one per chunk (length 1, never merged), padded with empty ones.

    Any other step lays its attention out in two layouts (`layouts`), each padded to a power of two of rows: its
    one-token chunks, one query per row, and its longer chunks in rows of QUERY_BLOCK queries (the compiled
    attention is static in its shapes: with a symbolic query length flex_attention found no kernel configuration
    on the H100). The flat tokens are not padded."""

    TENSORS = ("input_ids", "positions", "slots", "previous_rows", "page_owner", "page_index",
               "sample_rows")  # what a replayed graph reads (copy_from), besides its layout's

    def __init__(self, chunks: list[Chunk], block_size: int, num_pages: int, max_pages: int, device: torch.device,
                 padded_rows: int | None = None, staging: Staging | None = None):
        """`num_pages`: the pool's blocks (the trash page is one more); `max_pages`: the most one request holds."""
        # adapters first, grouped by slot; the base model's requests last
        self.chunks = chunks = sorted(chunks, key=lambda c: (c.slot is None, c.slot if c.slot is not None else 0))
        self.device, self.block_size = device, block_size
        ids, positions, slots, sample_rows, previous_rows, firsts = [], [], [], [], [], []
        page_owner = np.full(num_pages + 1, -1, dtype=np.int32)
        page_index = np.zeros(num_pages + 1, dtype=np.int32)
        for number, chunk in enumerate(chunks):
            table, end = chunk.request.blocks, chunk.start + len(chunk.tokens)
            pages = -(-end // block_size)
            firsts.append(len(ids))
            ids += chunk.tokens
            previous_rows += [-1] * (len(chunk.tokens) - 1) + [-1 if chunk.from_row is None else chunk.from_row]
            positions += range(chunk.start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(chunk.start, end)]
            page_owner[table[:pages]] = number
            page_index[table[:pages]] = np.arange(pages)
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
        tables = [c.request.blocks for c in chunks]
        decodes = [(n, firsts[n], c.start, 1) for n, c in enumerate(chunks) if len(c.tokens) == 1]
        prefills = [(n, firsts[n] + q0, c.start + q0, min(QUERY_BLOCK, len(c.tokens) - q0))
                    for n, c in enumerate(chunks) if len(c.tokens) > 1 for q0 in range(0, len(c.tokens), QUERY_BLOCK)]
        if padded_rows is not None:
            trash = num_pages * block_size
            for row in range(len(chunks), padded_rows):  # padding tokens: rows of the decode layout, reading nothing
                decodes.append((-2, len(ids), 0, 1))
                ids.append(0)
                previous_rows.append(-1)
                positions.append(0)
                slots.append(trash)
                sample_rows.append(row)
        host = {"input_ids": ids, "positions": positions, "slots": slots, "previous_rows": previous_rows,
                "sample_rows": sample_rows, "page_owner": page_owner, "page_index": page_index}
        specs = []  # (name, rows, queries per row, padded rows)
        if decodes:
            specs.append(("decode", decodes, 1, len(decodes) if padded_rows is not None else bucket(len(decodes))))
        if prefills:
            specs.append(("prefill", prefills, QUERY_BLOCK, bucket(len(prefills))))
        longest = {}
        for name, rows, queries, padded in specs:
            arrays, longest[name] = AttentionLayout.arrays(name, rows, tables, queries, padded, block_size, num_pages,
                                                           max_pages)
            host.update(arrays)
        self.sampled_chunks = [c for c in chunks if c.sample]
        self.token_runs = _runs([c.slot for c in chunks], [len(c.tokens) for c in chunks])  # host-side, as below
        if padded_rows is None:
            token_segments = _segment_arrays(self.token_runs)
            row_segments = _segment_arrays(_runs([c.slot for c in self.sampled_chunks], [1] * len(self.sampled_chunks)))
        else:  # one token, one sampled row per chunk: the same segments for both
            adapted = [c.slot for c in chunks if c.slot is not None]
            token_segments = row_segments = None if not adapted else _segment_arrays(
                [(row, row + 1, slot) for row, slot in enumerate(adapted)], pad_to=padded_rows)
        # one upload per distinct segments (the padded layout's token and row segments are one object, so that
        # copy_from updates both)
        segment_arrays = {"token": token_segments}
        if row_segments is not token_segments:
            segment_arrays["row"] = row_segments
        for name, arrays in segment_arrays.items():
            if arrays is not None:
                host[f"{name}_starts"], host[f"{name}_slots"] = arrays[:2]
        tensors = _upload(host, device, staging)
        for name in self.TENSORS:
            setattr(self, name, tensors[name])
        self.layouts = [AttentionLayout(name, tensors, longest[name], one_token_rows=padded_rows is not None,
                                        whole=len(specs) == 1, block_size=block_size) for name, _, _, _ in specs]
        segments = {name: None if arrays is None else Segments(tensors[f"{name}_starts"], tensors[f"{name}_slots"],
                                                               arrays[2]) for name, arrays in segment_arrays.items()}
        self.token_segments = segments["token"]
        self.row_segments = segments.get("row", self.token_segments)

    def copy_from(self, other: "StepBatch") -> None:
        """Take `other`'s values into this batch's tensors (same shapes and layouts), in place: a graph captured on
        this batch then runs `other`."""
        for name in self.TENSORS:
            getattr(self, name).copy_(getattr(other, name))
        for mine, theirs in zip(self.layouts, other.layouts, strict=True):
            mine.copy_from(theirs)
        if self.token_segments is not None:
            self.token_segments.starts.copy_(other.token_segments.starts)
            self.token_segments.slots.copy_(other.token_segments.slots)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _visible(position, query_position, sliding_window: int | None):
    """Causal attention, within the sliding window if there is one."""
    seen = position <= query_position
    if sliding_window is not None:
        seen = seen & (position > query_position - sliding_window)
    return seen
