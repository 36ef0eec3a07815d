"""PLOT lookups on a device (a GPU): a `Plot`'s tables copied there once, a whole batch looked up at once.

`Plot` (lookup.py) looks sequences up one by one in memory-mapped tables on the host, which suits tables larger than
the GPU can spare and lookups that overlap the GPU's work. Where the tables fit on the device beside the model,
`DevicePlot` does the same lookups there, for every sequence of a padded batch together: per fragment length and
table, one `searchsorted` over the packed keys and one gather of the values (dense selects throughout: the host
never waits for the device mid-batch), then the same aggregation as
`Plot.represent` (the decoder's longest fragment ending at each token; the encoder's normalized sum over the covering
fragments of the longest length that has any). The results equal `Plot.represent`'s (tested), so a model's lower
layers cost a few kernels a batch instead of host work and a copy to the device.

    device_plot = DevicePlot(Plot(root, domain), "cuda")
    hidden, mask = device_plot.padded(sequences)          # [B, T, d] right-padded with zeros, [B, T]
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from symbiosis.kernels import plot_lookup
from symbiosis.plot.lookup import Plot, checked_sequences


class DevicePlot:
    def __init__(self, plot: Plot, device):
        self.plot, self.device = plot, torch.device(device)
        self.kind, self.n, self.vocab, self.hidden, self.root = plot.kind, plot.n, plot.vocab, plot.hidden, plot.root
        self.dtype = torch.from_numpy(np.zeros(0, dtype=plot.dtype)).dtype  # as Plot computes: at least float32
        # per table, domain first: length -> (keys int64 [N] sorted, values [N, length, hidden] in the table's dtype)
        self.tables = [{length: (torch.from_numpy(np.array(level.keys)).to(self.device),  # copies of the maps
                                 torch.from_numpy(np.array(level.values)).to(self.device))
                        for length, level in table.levels.items() if level.keys.size}
                       for table in (plot.domain, plot.root) if table is not None]
        # on a GPU, one Triton kernel a batch (kernels/plot_lookup.py) over the tables packed into one buffer each
        # for keys and values, in place of the torch ops below (~100 launches a batch)
        self.packed = None
        if plot_lookup.triton is not None and self.device.type == "cuda" and self.dtype == torch.float32:
            self.pack()

    def pack(self) -> None:
        """The tables packed for `kernels.plot_lookup` (which the lookups then run by), the per-table copies let go."""
        if self.packed is not None:
            return
        values_dtype = functools.reduce(torch.promote_types, [v.dtype for t in self.tables for _, v in t.values()])
        self.packed = plot_lookup.PackedTables.pack(self.tables, self.n, self.hidden, values_dtype)
        self.tables = []

    def represent(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """As `Plot.represent`: each sequence's [T, hidden], on the host."""
        hidden, _ = self.padded(sequences)
        return [row[:len(s)].cpu().numpy() for row, s in zip(hidden, sequences)]

    @torch.no_grad()
    def padded(self, sequences: list[list[int]], dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the lower layers' stand-in [B, T, hidden] right-padded with zeros, in `dtype` (default: float32 or the
        tables' wider dtype); attention mask [B, T] int64), on the device."""
        arrays = checked_sequences(sequences, self.vocab)
        if not arrays:
            raise ValueError("no sequences to look up")
        # the padded batch made on the host in a few numpy operations, then one copy each way
        lengths = np.array([a.size for a in arrays], dtype=np.int64)
        mask = np.arange(lengths.max())[None, :] < lengths[:, None]
        tokens = np.zeros(mask.shape, dtype=np.int64)
        tokens[mask] = np.concatenate(arrays)
        tokens, mask = torch.from_numpy(tokens).to(self.device), torch.from_numpy(mask).to(self.device)
        if self.packed is not None:
            hidden = plot_lookup.lookup(self.kind, tokens, torch.from_numpy(lengths).to(self.device), self.packed,
                                        self.vocab, self.hidden)
        else:
            hidden = self._decoder(tokens, mask) if self.kind == "decoder" else self._encoder(tokens, mask)
        return hidden.to(dtype or self.dtype), mask.long()

    def _find(self, windows: torch.Tensor, wanted: torch.Tensor):
        """windows [B, S, G] (fragments), wanted bool [B, S] -> (values [B, S, G, hidden], found bool [B, S]): each
        wanted fragment's representations from the first table that holds it."""
        length = windows.shape[-1]
        keys = torch.zeros(windows.shape[:-1], dtype=torch.long, device=self.device)
        for column in range(length):  # packed as the tables' keys: first token most significant
            keys = keys * self.vocab + windows[..., column]
        values = torch.zeros(*windows.shape, self.hidden, dtype=self.dtype, device=self.device)
        found = torch.zeros_like(wanted)
        for table in self.tables:
            if length not in table:
                continue
            table_keys, table_values = table[length]
            rows = torch.searchsorted(table_keys, keys).clamp(max=table_keys.numel() - 1)
            hit = wanted & ~found & (table_keys[rows] == keys)
            # dense selects, not boolean indexing: a boolean index makes the host wait for the device's count
            values = torch.where(hit[..., None, None], table_values[rows].to(self.dtype), values)
            found |= hit
        return values, found

    def _decoder(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # token i: the last position of the longest fragment ending at it that a table holds
        out = torch.zeros(*tokens.shape, self.hidden, dtype=self.dtype, device=self.device)
        done = ~mask  # padding needs nothing
        for length in range(min(self.n, tokens.shape[1]), 0, -1):
            windows = tokens.unfold(1, length, 1)  # [B, S, G]: the fragment starting at s ends at s + G - 1
            values, found = self._find(windows, ~done[:, length - 1:])
            out[:, length - 1:] = torch.where(found[..., None], values[..., -1, :], out[:, length - 1:])
            done[:, length - 1:] |= found
        return out

    def _encoder(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # token i: the mean of its representations in the covering fragments of the longest length with any found
        total = torch.zeros(*tokens.shape, self.hidden, dtype=self.dtype, device=self.device)
        counts = torch.zeros(tokens.shape, dtype=torch.long, device=self.device)
        for length in range(min(self.n, tokens.shape[1]), 0, -1):
            open_ = (counts == 0) & mask  # tokens no longer fragment has covered (every length runs: no host wait)
            windows = tokens.unfold(1, length, 1)
            starts = windows.shape[1]
            values, found = self._find(windows, mask[:, length - 1:])  # fragments inside their sequence
            for offset in range(length):  # the fragment starting at s holds token s + offset at `offset`
                keep = found & open_[:, offset:offset + starts]
                total[:, offset:offset + starts] += values[:, :, offset] * keep[..., None]
                counts[:, offset:offset + starts] += keep
        return torch.where(mask[..., None], total / counts.clamp(min=1)[..., None], 0)
