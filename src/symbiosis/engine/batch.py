"""One engine step's batch, built once per step and read by every layer.

The step runs the tokens of several requests as one flat sequence of T tokens (batch dimension 1): each
scheduled request contributes a *chunk*, its tokens `start .. start + length - 1` (a whole decode step is one
token; a prefill is cut into chunks under the step's token budget). Chunks are laid out grouped by adapter slot, so
that each adapter's tokens are one contiguous segment for the SGMV kernels; requests without an adapter come
last and are in no segment.

Attention reads the KV pool in place (engine/attention.py): the step describes, per chunk, which pool blocks
(pages) its queries read, as a flex_attention block mask over the pool, and, per page, whose it is and which of
its owner's pages it is, so that each key's position in its request is known without a gathered copy.

Shapes (R chunks, Q = longest chunk, B = QUERY_BLOCK, P = max_pages, N = pool pages + 1 (the trash page),
K = rows sampled):
    input_ids, positions, slots   [T]              token, its position in its request, its flat KV slot
    previous_rows                 [T]              -1, or the row of the step before's sampled tokens that holds this
                                                   token (it was not read back yet: input_ids holds 0 there)
    query_index                    [R, Q]           flat token of each chunk's q-th query (padding: 0)
    query_positions                [R, Q]           position of each chunk's q-th query (padding: 0)
    query_rows                     [T]              row r * Q + q of the padded queries that each flat token is
    kv_num_blocks                  [R, 1, Q/B]      how many pages the queries q*B .. q*B+B-1 of chunk r read ...
    kv_indices                     [R, 1, Q/B, P]   ... and which: the first pages of r's block table
    page_owner, page_index         [N]              chunk that owns each page (-1: none), its index in that
                                                    chunk's block table
    sample_rows                    [K]              the flat rows whose logits are sampled (a chunk's last token,
                                                    when it reaches the end of what the request has so far)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from symbiosis.kernels.sgmv import Segments

QUERY_BLOCK = 128  # queries per block-mask row (flex_attention's default sparse block)
SHORTEST_QUERY_BUCKET = 16  # the fewest query rows per chunk a prefill step's attention is laid out with


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


def _upload(arrays: dict[str, object], device: torch.device) -> dict[str, torch.Tensor]:
    """Host arrays (numpy int32 / int64, or lists of ints: int64) as device tensors of their shapes, in one copy
    per dtype (from pinned memory, not waiting for the device, on a GPU)."""
    arrays = {name: np.asarray(a, dtype=np.int64) if not isinstance(a, np.ndarray) else a for name, a in arrays.items()}
    tensors = {}
    for dtype in (np.int32, np.int64):
        names = [name for name, a in arrays.items() if a.dtype == dtype]
        flat = torch.from_numpy(np.concatenate([arrays[name].ravel() for name in names]))
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        offset = 0
        for name in names:
            size = arrays[name].size
            tensors[name] = flat[offset:offset + size].view(arrays[name].shape)
            offset += size
    return tensors


class StepBatch:
    """`padded_rows`, for a decode step replayed from a CUDA graph (engine/graphs.py): every shape is fixed by the
    row count and nothing else: the chunks (one token each) are followed by padding rows (token 0 at position 0,
    written to the KV cache's trash slot, reading no page: their attention output is zero, their logits are
    never read), and the SGMV segments are one per chunk (length 1, never merged), padded with empty ones.

    Any other step with a chunk of several tokens lays its attention out in buckets, R and Q rounded up to powers
    of two (Q at least SHORTEST_QUERY_BUCKET): the compiled prefill attention is static in its shapes (with a
    symbolic query length flex_attention found no kernel configuration: H100 runs 61-62 and this session's), so a
    step's shapes must come from a small set. Padding query rows and chunks read no page and are never gathered
    back; the flat tokens are not padded."""

    TENSORS = ("input_ids", "positions", "slots", "previous_rows", "query_index", "query_positions", "query_rows", "kv_num_blocks",
               "kv_indices", "page_owner", "page_index", "sample_rows")  # what a replayed graph reads (copy_from)

    def __init__(self, chunks: list[Chunk], block_size: int, num_pages: int, max_pages: int, device: torch.device,
                 padded_rows: int | None = None):
        """`num_pages`: the pool's blocks (the trash page is one more); `max_pages`: the most one request holds."""
        # adapters first, grouped by slot; the base model's requests last
        self.chunks = chunks = sorted(chunks, key=lambda c: (c.slot is None, c.slot if c.slot is not None else 0))
        self.device, self.block_size = device, block_size
        self.one_token_rows = padded_rows is not None  # row r of the attention's layout is flat token r
        rows = len(chunks) if padded_rows is None else padded_rows
        longest_query = max(len(c.tokens) for c in chunks)
        if padded_rows is None and longest_query > 1:
            rows, longest_query = bucket(rows), max(SHORTEST_QUERY_BUCKET, bucket(longest_query))
        query_blocks = -(-longest_query // QUERY_BLOCK)
        ids, positions, slots, query_index, sample_rows, previous_rows = [], [], [], [], [], []
        query_positions = np.zeros((rows, longest_query), dtype=np.int64)
        kv_num_blocks = np.zeros((rows, 1, query_blocks), dtype=np.int32)
        kv_indices = np.full((rows, 1, query_blocks, max_pages), num_pages, dtype=np.int32)  # padding: the trash page
        page_owner = np.full(num_pages + 1, -1, dtype=np.int32)
        page_index = np.zeros(num_pages + 1, dtype=np.int32)
        self.longest_pages = 0
        for row, chunk in enumerate(chunks):
            table, end = chunk.request.blocks, chunk.start + len(chunk.tokens)
            pages = -(-end // block_size)
            first = len(ids)
            ids += chunk.tokens
            previous_rows += [-1] * (len(chunk.tokens) - 1) + [-1 if chunk.from_row is None else chunk.from_row]
            positions += range(chunk.start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(chunk.start, end)]
            query_index.append(list(range(first, len(ids))) + [0] * (longest_query - len(chunk.tokens)))
            query_positions[row, :len(chunk.tokens)] = np.arange(chunk.start, end)
            for block in range(-(-len(chunk.tokens) // QUERY_BLOCK)):  # the pages up to the block's last query
                last = chunk.start + min((block + 1) * QUERY_BLOCK, len(chunk.tokens))
                kv_num_blocks[row, 0, block] = -(-last // block_size)
            kv_indices[row, 0, :, :pages] = table[:pages]
            self.longest_pages = max(self.longest_pages, pages)
            page_owner[table[:pages]] = row
            page_index[table[:pages]] = np.arange(pages)
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
        lengths = [len(c.tokens) for c in chunks]
        if padded_rows is not None:
            trash = num_pages * block_size
            for row in range(len(chunks), rows):
                ids.append(0)
                previous_rows.append(-1)
                positions.append(0)
                slots.append(trash)
                query_index.append([row])
                sample_rows.append(row)
            lengths += [1] * (rows - len(chunks))
        else:
            query_index += [[0] * longest_query] * (rows - len(chunks))
        self.sampled_chunks = [c for c in chunks if c.sample]
        self.token_runs = _runs([c.slot for c in chunks], [len(c.tokens) for c in chunks])  # host-side, as below
        if padded_rows is None:
            token_segments = _segment_arrays(self.token_runs)
            row_segments = _segment_arrays(_runs([c.slot for c in self.sampled_chunks], [1] * len(self.sampled_chunks)))
        else:  # one token, one sampled row per chunk: the same segments for both
            adapted = [c.slot for c in chunks if c.slot is not None]
            token_segments = row_segments = None if not adapted else _segment_arrays(
                [(row, row + 1, slot) for row, slot in enumerate(adapted)], pad_to=rows)

        host = {"input_ids": ids, "positions": positions, "slots": slots, "previous_rows": previous_rows,
                "query_index": query_index,
                "query_positions": query_positions, "sample_rows": sample_rows,
                # rows of the [R * Q] padded queries that are real, in flat token order (an index, not a mask: a
                # boolean index makes the device count its rows before every layer's attention can return)
                "query_rows": [r * longest_query + q for r, length in enumerate(lengths) for q in range(length)],
                "kv_num_blocks": kv_num_blocks, "kv_indices": kv_indices, "page_owner": page_owner,
                "page_index": page_index}
        # one upload per distinct segments (the padded layout's token and row segments are one object, so that
        # copy_from updates both)
        segment_arrays = {"token": token_segments}
        if row_segments is not token_segments:
            segment_arrays["row"] = row_segments
        for name, arrays in segment_arrays.items():
            if arrays is not None:
                host[f"{name}_starts"], host[f"{name}_slots"] = arrays[:2]
        tensors = _upload(host, device)
        for name in self.TENSORS:
            setattr(self, name, tensors[name])
        segments = {name: None if arrays is None else Segments(tensors[f"{name}_starts"], tensors[f"{name}_slots"],
                                                               arrays[2]) for name, arrays in segment_arrays.items()}
        self.token_segments = segments["token"]
        self.row_segments = segments.get("row", self.token_segments)
        self._block_masks: dict[int | None, object] = {}

    def copy_from(self, other: "StepBatch") -> None:
        """Take `other`'s values into this batch's tensors (same shapes), in place: a graph captured on this
        batch then runs `other`."""
        for name in self.TENSORS:
            getattr(self, name).copy_(getattr(other, name))
        self.longest_pages = other.longest_pages  # read on the host (context_slots)
        if self.token_segments is not None:
            self.token_segments.starts.copy_(other.token_segments.starts)
            self.token_segments.slots.copy_(other.token_segments.slots)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def block_mask(self, sliding_window: int | None):
        """flex_attention's BlockMask over the whole KV pool ([pages * block_size] keys, page = block): query q of
        chunk r reads the key at pool slot k when k's page is r's and k's position in r is visible from q's. The
        pages listed per query block make the GPU's kernels skip every other page."""
        if sliding_window not in self._block_masks:
            from torch.nn.attention.flex_attention import BlockMask

            owner, index, query_positions, size = self.page_owner, self.page_index, self.query_positions, self.block_size

            def visible(b, h, q, k):
                page = k // size
                return (owner[page] == b) & _visible(index[page] * size + k % size, query_positions[b, q], sliding_window)

            self._block_masks[sliding_window] = BlockMask.from_kv_blocks(
                self.kv_num_blocks, self.kv_indices, BLOCK_SIZE=(QUERY_BLOCK, size), mask_mod=visible,
                seq_lengths=(self.query_index.shape[1], self.page_owner.shape[0] * size), compute_q_blocks=False)
        return self._block_masks[sliding_window]

    def context_slots(self) -> torch.Tensor:
        """[R, longest_pages * block_size]: the pool slot of each chunk's context position (the positions of pages
        it does not have: slots of the trash page), for attention over gathered contexts (the CPU's)."""
        pages = self.kv_indices[:, 0, 0, :self.longest_pages].long()
        return (pages[:, :, None] * self.block_size + torch.arange(self.block_size, device=self.device)).flatten(1)

    def context_mask(self, sliding_window: int | None):
        """The mask_mod over gathered contexts (`context_slots`): key k of chunk r is r's position k."""
        query_positions = self.query_positions
        return lambda b, h, q, k: _visible(k, query_positions[b, q], sliding_window)


def _visible(position, query_position, sliding_window: int | None):
    """Causal attention, within the sliding window if there is one."""
    seen = position <= query_position
    if sliding_window is not None:
        seen = seen & (position > query_position - sliding_window)
    return seen
