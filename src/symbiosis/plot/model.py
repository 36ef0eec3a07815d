"""Inference with PLOT (HMI §3.3): lookups and aggregation stand in for the lower layers, the upper layers (with a
tenant's adapter, when its model is wrapped by PEFT) compute the rest.

    plot = Plot(PlotTable.open("root"), PlotTable.open("domains/bio"))
    model = PlotModel(UpperModel(model_dir, k), plot)
    logits = model.logits([[101, 7592, 102], [101, 2088, 102]])      # [B, T, vocab], or [B, labels] (encoder)
    for logits in model.pipelined(batches): ...                       # lookups of batch t+1 beside batch t
    tokens = model.generate(prompt, max_new_tokens=16)                # decoders: greedy, one lookup per new token
    generate_many(upper, [Generation(plot, prompt, 16, "tenant-a"), ...])  # several prompts, tables, adapters at once

Lookups are numpy work on the host (and the mapped table's pages); `pipelined` runs those of the next batch on a
thread while the device runs the current batch's upper layers (HMI §6, Fig. 10).
"""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from transformers import DynamicCache

from symbiosis.plot.device import DevicePlot
from symbiosis.plot.lookup import Plot
from symbiosis.plot.split import UpperModel


class PlotModel:
    def __init__(self, upper: UpperModel, plot: Plot | DevicePlot):
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
        if isinstance(self.plot, DevicePlot):  # looked up where the tables are, the whole batch at once
            hidden, mask = self.plot.padded(sequences, self.upper.model.dtype)
            return hidden.to(self.upper.device), mask.to(self.upper.device)
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

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens after `prompt` (decoders): the prompt's representations at once, then each new token's
        from its one fragment, the upper layers on their KV cache."""
        return generate_many(self.upper, [Generation(self.plot, prompt, max_new_tokens)])[0]


@dataclass
class Generation:
    """One prompt of `generate_many`: its tables, its tokens, how many to add, its adapter (a PEFT adapter name of
    the upper model; None: the model as it is), and the prompt's representations [T, d] if already looked up (a
    service looks them up as a request arrives, beside the batch the GPU is running)."""
    plot: Plot
    prompt: list[int]
    max_new_tokens: int
    adapter: str | None = None
    representation: np.ndarray | None = None


@torch.no_grad()
def generate_many(upper: UpperModel, generations: list[Generation],
                  done: Callable[[int, list[int]], None] | None = None) -> list[list[int]]:
    """Greedy tokens for several prompts in one batch (decoders), each with its own tables, length and adapter:
    the prompts' representations left-padded into [B, T, d] (mask and positions to match), then one step per new
    token for all rows, each row's next input the fragment ending at its new token, looked up in its own tables.
    Row by row the tokens each makes alone. Rows that are done ride along until the longest is; `done(row,
    tokens)` hears of each as soon as it is (so that its answer need not wait for the longest)."""
    if not generations:
        return []
    if any(g.plot.kind != "decoder" for g in generations):
        raise ValueError("generation needs a decoder's tables")
    named = [g.adapter is not None for g in generations]
    if any(named) and not all(named):
        raise ValueError("either every prompt of a batch names its adapter or none does")
    device, dtype = upper.device, upper.model.dtype
    representations = [g.representation if g.representation is not None else g.plot.represent([g.prompt])[0]
                       for g in generations]
    hidden, mask = _pad(representations, device, dtype, left=True)  # every row's newest position is the last
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    options = {cache_argument(upper.model): DynamicCache(config=upper.model.config)}
    if all(named):
        options["adapter_names"] = [g.adapter for g in generations]
    tokens = [list(g.prompt) for g in generations]
    new: list[list[int]] = [[] for _ in generations]
    steps = max(g.max_new_tokens for g in generations)
    for step in range(steps):
        logits = upper.logits(hidden, mask, use_cache=True, position_ids=positions, **options)
        for row, token in enumerate(logits[:, -1].argmax(-1).tolist()):
            tokens[row].append(token)
            if len(new[row]) < generations[row].max_new_tokens:
                new[row].append(token)
                if done is not None and len(new[row]) == generations[row].max_new_tokens:
                    done(row, new[row])
        if step == steps - 1:
            break
        last = np.stack([g.plot.represent([t[-g.plot.n:]])[0][-1] for g, t in zip(generations, tokens)])
        hidden = torch.as_tensor(last, device=device, dtype=dtype)[:, None]  # [B, 1, d]
        mask = torch.cat([mask, mask.new_ones(len(generations), 1)], dim=1)
        positions = positions[:, -1:] + 1
    return new


def cache_argument(model) -> str:
    """What the model's forward calls its KV cache (`past_key_values` before transformers 5.2x, then `cache`); of a
    PEFT model, its base model's."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _pad(representations: list[np.ndarray], device, dtype, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T, d] padded with zeros on the right, or the left; attention mask [B, T])."""
    longest = max(r.shape[0] for r in representations)
    hidden = torch.zeros(len(representations), longest, representations[0].shape[1], dtype=dtype)
    mask = torch.zeros(len(representations), longest, dtype=torch.long)
    for row, r in enumerate(representations):
        place = slice(longest - r.shape[0], None) if left else slice(0, r.shape[0])
        hidden[row, place] = torch.from_numpy(r)
        mask[row, place] = 1
    return hidden.to(device), mask.to(device)
