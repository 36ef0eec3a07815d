"""Inference with PLOT (HMI §3.3): lookups and aggregation stand in for the lower layers, the upper layers (with a
tenant's adapter, when its model is wrapped by PEFT) compute the rest.

    plot = Plot(PlotTable.open("root"), PlotTable.open("domains/bio"))
    model = PlotModel(UpperModel(model_dir, k), plot)
    logits = model.logits([[101, 7592, 102], [101, 2088, 102]])      # [B, T, vocab], or [B, labels] (encoder)
    for logits in model.pipelined(batches): ...                       # lookups of batch t+1 beside batch t
    tokens = model.generate(prompt, max_new_tokens=16)                # decoders: greedy, one lookup per new token

Lookups are numpy work on the host (and the mapped table's pages); `pipelined` runs those of the next batch on a
thread while the device runs the current batch's upper layers (HMI §6, Fig. 10).
"""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np
import torch
from transformers import DynamicCache

from symbiosis.plot.lookup import Plot
from symbiosis.plot.split import UpperModel


class PlotModel:
    def __init__(self, upper: UpperModel, plot: Plot):
        if (upper.kind, upper.lower_layers) != (plot.kind, plot.root.lower_layers):
            raise ValueError(f"the tables are for the {plot.kind} cut at layer {plot.root.lower_layers}, the model is "
                             f"a {upper.kind} cut at layer {upper.lower_layers}")
        config = upper.model.config
        if (config.vocab_size, config.hidden_size) != (plot.vocab, plot.hidden):
            raise ValueError(f"the tables are for a vocabulary of {plot.vocab} and hidden size {plot.hidden}, the "
                             f"model has {config.vocab_size} and {config.hidden_size}")
        self.upper, self.plot = upper, plot

    def hidden(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the lower layers' stand-in [B, T, d], right-padded with zeros; attention mask [B, T])."""
        return _pad(self.plot.represent(sequences), self.upper.device, self.upper.model.dtype)

    @torch.no_grad()
    def logits(self, sequences: list[list[int]]) -> torch.Tensor:
        return self._upper(*self.hidden(sequences))

    def _upper(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.upper.logits(hidden, mask)

    @torch.no_grad()
    def pipelined(self, batches: Iterable[list[list[int]]]) -> Iterator[torch.Tensor]:
        """Each batch's logits, the next batch's lookups running on a thread meanwhile."""
        with ThreadPoolExecutor(1, thread_name_prefix="plot-lookup") as lookups:
            batches = iter(batches)
            pending = next((lookups.submit(self.hidden, b) for b in batches), None)
            while pending is not None:
                hidden, mask = pending.result()
                pending = next((lookups.submit(self.hidden, b) for b in batches), None)
                yield self._upper(hidden, mask)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens after `prompt` (decoders): the prompt's representations at once, then each new token's
        from its one fragment, the upper layers on their KV cache."""
        if self.plot.kind != "decoder":
            raise ValueError("generation needs a decoder's tables")
        tokens = list(prompt)
        hidden, _ = self.hidden([tokens])
        cache = {cache_argument(self.upper.model): DynamicCache(config=self.upper.model.config)}
        new = []
        for _ in range(max_new_tokens):
            logits = self.upper.logits(hidden, None, use_cache=True, **cache)
            new.append(int(logits[0, -1].argmax()))
            tokens.append(new[-1])
            last = self.plot.represent([tokens[-self.plot.n:]])[0][-1:]  # the fragment ending at the new token
            hidden = torch.as_tensor(last, device=self.upper.device, dtype=self.upper.model.dtype)[None]
        return new


def cache_argument(model) -> str:
    """What the model's forward calls its KV cache (`past_key_values` before transformers 5.2x, then `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _pad(representations: list[np.ndarray], device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(r.shape[0] for r in representations)
    hidden = torch.zeros(len(representations), longest, representations[0].shape[1], dtype=dtype)
    mask = torch.zeros(len(representations), longest, dtype=torch.long)
    for row, r in enumerate(representations):
        hidden[row, :r.shape[0]] = torch.from_numpy(r)
        mask[row, :r.shape[0]] = 1
    return hidden.to(device), mask.to(device)
