"""Representations from PLOT tables instead of the lower layers (HMI §3.3.1, §5.1).

A sequence's fragments are looked up in the domain's table first, then the root's (HMI eq. 3); a fragment in
neither backs off to shorter ones, down to uni-grams, which the root holds for the whole vocabulary. Then:

- encoder (BERT family): token i is covered by the G-grams starting at i-G+1 .. i. Its representation is the
  normalized sum (HMI eq. 2) of its representations in those covering fragments that were found, at the longest
  length G at which at least one was: sum_j H_j[i - j] / (how many were summed). With every tri-gram found that is
  the mean of its three tri-gram representations, [x(i-2),x(i-1),x(i)], [x(i-1),x(i),x(i+1)], [x(i),x(i+1),x(i+2)].
- decoder (causal): token i sees only what comes before it, so its representation is the last position of the
  longest fragment ending at it that was found: [x(i-2), x(i-1), x(i)], else [x(i-1), x(i)], else [x(i)]. A new
  token's representation needs only the tokens before it: generation looks up one fragment per step.

For a sequence no longer than the longest fragment, a decoder's lookups are exactly the lower layers' output (every
prefix is one of the fragments), as is an encoder's when the whole sequence is in the table.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from symbiosis.plot.table import PlotTable, PlotTableError


def checked_sequences(sequences: list[list[int]], vocab: int) -> list[np.ndarray]:
    """The sequences as int64 arrays; `PlotTableError` unless each is 1 or more token ids of the vocabulary."""
    arrays = [np.asarray(s, dtype=np.int64) for s in sequences]
    for array in arrays:
        if array.ndim != 1 or array.size == 0 or array.min() < 0 or array.max() >= vocab:
            raise PlotTableError(f"a sequence must be 1 or more token ids in 0..{vocab - 1}")
    return arrays


class Plot:
    """A domain version's lookups: `domain` (its top alpha% fragments; None: the root alone) over `root`."""

    def __init__(self, root: PlotTable, domain: PlotTable | None = None):
        if root.entries()[1] != root.vocab:
            raise PlotTableError(f"{root.directory}: a root table holds a uni-gram for every token of the vocabulary "
                                 f"({root.vocab}); this one holds {root.entries()[1]}")
        if domain is not None:
            for field in ("kind", "vocab", "hidden", "lower_layers"):
                if domain.meta[field] != root.meta[field]:
                    raise PlotTableError(f"{domain.directory}: its {field} ({domain.meta[field]}) is not its root's "
                                         f"({root.meta[field]})")
            if domain.meta.get("root") not in (None, root.meta.get("id")):
                raise PlotTableError(f"{domain.directory}: built over another root table")
        self.root, self.domain = root, domain
        self.kind, self.n, self.vocab, self.hidden = root.kind, root.n, root.vocab, root.hidden
        self.dtype = np.result_type(root.levels[1].values.dtype, np.float32)

    def find(self, fragments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """fragments int64 [M, G] -> (values [M, G, hidden], found bool [M]): the domain's, else the root's."""
        length = fragments.shape[1]
        values = np.zeros((fragments.shape[0], length, self.hidden), dtype=self.dtype)
        found = np.zeros(fragments.shape[0], dtype=bool)
        for table in (self.domain, self.root):
            if table is None or length > table.n:
                continue
            missing = np.flatnonzero(~found)
            rows, hit = table.find(fragments[missing])
            values[missing[hit]] = table.rows(length, rows[hit])
            found[missing[hit]] = True
        return values, found

    def represent(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """Each sequence's stand-in for the lower layers' output, [T, hidden]."""
        aggregate = self._decoder if self.kind == "decoder" else self._encoder
        return [aggregate(array) for array in checked_sequences(sequences, self.vocab)]

    def _decoder(self, tokens: np.ndarray) -> np.ndarray:
        out = np.zeros((tokens.size, self.hidden), dtype=self.dtype)
        done = np.zeros(tokens.size, dtype=bool)
        for length in range(min(self.n, tokens.size), 0, -1):
            ends = np.flatnonzero(~done[length - 1:]) + length - 1  # tokens still without one, with room behind
            values, found = self.find(sliding_window_view(tokens, length)[ends - length + 1])
            out[ends[found]] = values[found, -1]
            done[ends[found]] = True
        return out

    def _encoder(self, tokens: np.ndarray) -> np.ndarray:
        total = np.zeros((tokens.size, self.hidden), dtype=self.dtype)
        counts = np.zeros(tokens.size, dtype=np.int64)
        for length in range(min(self.n, tokens.size), 0, -1):
            open_ = counts == 0  # tokens no longer fragment has covered
            if not open_.any():
                break
            values, found = self.find(sliding_window_view(tokens, length))
            for offset in range(length):  # the fragment starting at j holds token j + offset at `offset`
                starts = np.flatnonzero(found)
                targets = starts + offset
                keep = open_[targets]
                np.add.at(total, targets[keep], values[starts[keep], offset])
                np.add.at(counts, targets[keep], 1)
        return total / counts[:, None]
