"""Choosing each request's next token from its logits row, the way transformers' generate() does.

    greedy (temperature 0):   argmax(logits)
    sampled:                  z = logits / temperature;  keep the top_k largest of z (0: all);
                              keep the smallest set of most likely tokens whose probability reaches top_p;
                              draw one from softmax(z) over what is kept, with the request's generator
    logprob (if asked):       log_softmax(logits)[token], and the `logprobs` largest alternatives
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from symbiosis.engine.params import SamplingParams


@dataclass
class Choice:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    z = logits / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(z)  # ascending, as transformers' TopPLogitsWarper
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[-1] = False  # the most likely token always stays
        z = z.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return z


def choose(logits: torch.Tensor, requests: list, generators: list) -> list[Choice]:
    """logits [K, V] (float32 or wider), one row per request (whose `.params` say how) -> one Choice each."""
    greedy = logits.argmax(-1).tolist()  # one device sync for every greedy row
    choices = []
    for row, request, generator, best in zip(logits, requests, generators, greedy):
        params: SamplingParams = request.params
        token = best
        if params.temperature > 0:
            probabilities = _filtered(row, params).softmax(-1)
            token = int(torch.multinomial(probabilities, 1, generator=generator))
        choice = Choice(token)
        if params.logprobs is not None:
            logprobs = row.log_softmax(-1)
            choice.logprob = float(logprobs[token])
            if params.logprobs:
                values, indices = torch.topk(logprobs, params.logprobs)
                choice.top_logprobs = list(zip(indices.tolist(), values.tolist()))
        choices.append(choice)
    return choices
