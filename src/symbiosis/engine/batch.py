"""One engine step's batch, built once per step and read by every layer.

The step runs the tokens of several requests as one flat sequence of T tokens (batch dimension 1): each
scheduled request contributes a *chunk*, its tokens `start .. start + length - 1` (a whole decode step is one
token; a prefill is cut into chunks under the step's token budget). Chunks are laid out grouped by adapter slot, so
that each adapter's tokens are one contiguous segment for the SGMV kernels; requests without an adapter come
last and are in no segment.

Shapes (R chunks, Q = longest chunk, L = longest context, K = rows sampled):
    input_ids, positions, slots   [T]       token, its position in its request, its flat KV slot
    query_index                    [R, Q]    flat token of each chunk's q-th query (padding: 0)
    query_valid                    [R, Q]
    query_rows                     [T]       row r * Q + q of the padded queries that each flat token is
    context_slots                  [R, L]    flat KV slot of each chunk's context position l (padding: 0)
    context_positions              [L]       0 .. L-1
    sample_rows                    [K]       the flat rows whose logits are sampled (a chunk's last token, when
                                             it reaches the end of what the request has so far)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from symbiosis.kernels.sgmv import Segments


@dataclass
class Chunk:
    request: object  # engine.scheduler.Request
    start: int
    tokens: list[int]
    slot: int | None  # adapter slot, None: the base model alone
    sample: bool


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


def _segments(runs: list[tuple[int, int, int]], device: torch.device) -> Segments | None:
    if not runs:
        return None
    return Segments.from_lengths([end - first for first, end, _ in runs], [slot for _, _, slot in runs], device=device)


class StepBatch:
    """`padded` = (rows, context, trash slot), for a decode step replayed from a CUDA graph (engine/graphs.py):
    every shape is fixed by (rows, context) and nothing else: the chunks (one token each) are followed by
    padding rows (token 0 at position 0, written to and reading only the KV cache's trash slot, sampled but
    never read), contexts are padded to `context`, and the SGMV segments are one per chunk (length 1, never
    merged), padded with empty ones to `rows`."""

    TENSORS = ("input_ids", "positions", "slots", "query_index", "context_slots", "query_valid", "query_positions",
               "query_rows", "context_positions", "sample_rows")  # what a replayed graph reads (copy_from)

    def __init__(self, chunks: list[Chunk], block_size: int, device: torch.device,
                 padded: tuple[int, int, int] | None = None):
        # adapters first, grouped by slot; the base model's requests last
        self.chunks = chunks = sorted(chunks, key=lambda c: (c.slot is None, c.slot if c.slot is not None else 0))
        self.device = device
        ids, positions, slots, query_index, context_slots, sample_rows = [], [], [], [], [], []
        longest_query = max(len(c.tokens) for c in chunks)
        longest_context = max(c.start + len(c.tokens) for c in chunks) if padded is None else padded[1]
        for chunk in chunks:
            table = chunk.request.blocks
            flat = [table[p // block_size] * block_size + p % block_size for p in range(chunk.start + len(chunk.tokens))]
            first = len(ids)
            ids += chunk.tokens
            positions += range(chunk.start, chunk.start + len(chunk.tokens))
            slots += flat[chunk.start:]
            query_index.append(list(range(first, len(ids))) + [0] * (longest_query - len(chunk.tokens)))
            context_slots.append(flat + [0] * (longest_context - len(flat)))
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
        lengths = [len(c.tokens) for c in chunks]
        if padded is not None:
            rows, _, trash = padded
            for row in range(len(chunks), rows):
                ids.append(0)
                positions.append(0)
                slots.append(trash)
                query_index.append([row])
                context_slots.append([trash] * longest_context)
                sample_rows.append(row)
            lengths += [1] * (rows - len(chunks))
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        self.input_ids, self.positions, self.slots = as_long(ids), as_long(positions), as_long(slots)
        self.query_index, self.context_slots = as_long(query_index), as_long(context_slots)
        self.query_valid = torch.arange(longest_query, device=device)[None, :] < as_long(lengths)[:, None]
        self.query_positions = self.positions[self.query_index].masked_fill(~self.query_valid, 0)  # [R, Q]
        # rows of the [R * Q] padded queries that are real, in flat token order (an index, not a mask: a boolean
        # index makes the device count its rows before every layer's attention can return)
        self.query_rows = as_long([r * longest_query + q for r, length in enumerate(lengths) for q in range(length)])
        self.context_positions = torch.arange(longest_context, device=device)
        self.sample_rows = as_long(sample_rows)
        self.sampled_chunks = [c for c in chunks if c.sample]
        self.token_runs = _runs([c.slot for c in chunks], [len(c.tokens) for c in chunks])  # host-side, as below
        if padded is None:
            self.token_segments = _segments(self.token_runs, device)
            self.row_segments = _segments(_runs([c.slot for c in self.sampled_chunks], [1] * len(self.sampled_chunks)), device)
        else:  # one token, one sampled row per chunk: the same segments for both
            adapted = [c.slot for c in chunks if c.slot is not None]
            self.token_segments = self.row_segments = None if not adapted else Segments.from_lengths(
                [1] * len(adapted) + [0] * (padded[0] - len(adapted)), adapted + [0] * (padded[0] - len(adapted)),
                device=device)
        self._masks: dict[tuple[int | None, int], torch.Tensor] = {}

    def copy_from(self, other: "StepBatch") -> None:
        """Take `other`'s values into this batch's tensors (same shapes), in place: a graph captured on this
        batch then runs `other`."""
        for name in self.TENSORS:
            getattr(self, name).copy_(getattr(other, name))
        self._masks.clear()  # made again from the new positions (inside a graph, by the graph)
        if self.token_segments is not None:
            self.token_segments.starts.copy_(other.token_segments.starts)
            self.token_segments.slots.copy_(other.token_segments.slots)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def mask(self, sliding_window: int | None, group: int = 1) -> torch.Tensor:
        """[R, 1, group * Q, L] bool: query q of chunk r sees context position l (causal, within the window if
        any), repeated for the `group` query heads that share a key/value head (rows ordered (head, q))."""
        if (sliding_window, group) not in self._masks:
            q = self.query_positions[:, None, :, None]
            l = self.context_positions[None, None, None, :]  # noqa: E741
            allowed = l <= q
            if sliding_window is not None:
                allowed = allowed & (l > q - sliding_window)
            self._masks[sliding_window, group] = allowed.repeat(1, 1, group, 1)
        return self._masks[sliding_window, group]
