"""Choosing each request's next token from its logits row, the way transformers' generate() does.

    greedy (temperature 0):   argmax(logits)
    sampled:                  z = logits / temperature;  keep the top_k largest of z (0: all);
                              keep the smallest set of most likely tokens whose probability reaches top_p;
                              draw one from softmax(z) over what is kept, with the request's generator (seeded
                              requests; the others' rows together, from the device's default generator)
    logprob (if asked):       log_softmax(logits)[token], and the `logprobs` largest alternatives

In two halves, so that the host need not wait for the device in between (engine.py runs the next step meanwhile):
`launch` queues every choice on the device and the copies of the results to the host; `Launched.read` waits for
them. A row whose logits are not finite chooses nothing (`None`): its request fails.
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


class Launched:
    """The choices of one step, queued on the device: `tokens` [K] stays there (the next step's decodes read it
    before the host has); `read()` waits for the host's copies."""

    def __init__(self, tokens, finite, logprob_rows, chosen, top):
        self.tokens = tokens
        self.logprob_rows = logprob_rows  # row -> its index in chosen / top
        copies = [t for t in (tokens, finite, chosen) + (top or ()) if t is not None]
        self._host = [t.to("cpu", non_blocking=True) for t in copies]
        self._ready = None
        if tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def wait(self) -> None:
        """Until the host's copies are there (on the CPU they are at once)."""
        if self._ready is not None:
            self._ready.synchronize()

    def read(self, requests: list) -> list[Choice | None]:
        self.wait()
        tokens, finite, *rest = [t.tolist() for t in self._host]
        chosen, top_values, top_indices = (rest + [None, None, None])[:3]
        choices = []
        for row, (request, token, ok) in enumerate(zip(requests, tokens, finite)):
            if not ok:
                choices.append(None)
                continue
            choice = Choice(token)
            index = self.logprob_rows.get(row)
            if index is not None:
                choice.logprob = chosen[index]
                if request.params.logprobs:
                    n = request.params.logprobs
                    choice.top_logprobs = list(zip(top_indices[index][:n], top_values[index][:n]))
            choices.append(choice)
        return choices


def _filtered_rows(z: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """z [R, V] over each row's temperature, with -inf where its top_k and top_p drop a token (as transformers'
    warpers), each row with its own parameters, in a few calls for all the rows."""
    vocabulary, device = z.shape[-1], z.device
    z = z / torch.tensor([p.temperature for p in params], dtype=z.dtype, device=device)[:, None]
    ks = [p.top_k if p.top_k and p.top_k < vocabulary else 0 for p in params]
    if any(ks):
        kth = torch.topk(z, max(ks)).values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=device)[:, None], float("-inf"))  # [R, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        ordered, order = torch.sort(z)  # ascending, as transformers' TopPLogitsWarper
        cumulative = ordered.softmax(-1).cumsum(-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=cumulative.dtype, device=device)[:, None]
        drop = (cumulative <= 1 - top_p) & (top_p < 1.0)
        drop[:, -1] = False  # the most likely token always stays
        z = z.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return z


def launch(logits: torch.Tensor, requests: list) -> Launched:
    """logits [K, V] (any float dtype), one row per request (whose `.params` say how and `.generator` draws: a
    seeded request's own generator, row by row; the rows of requests without one (no seed) drawn together from
    the device's default generator, in a few calls whatever their number: row by row, 64 sampled requests cost the
    engine's thread ~0.5k kernel launches a step)."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    finite = torch.isfinite(logits).all(-1)                                                # [K]
    tokens = logits.argmax(-1)                                                             # [K]
    shared = []
    for row, request in enumerate(requests):
        params: SamplingParams = request.params
        if params.temperature > 0 and request.generator is None:
            shared.append(row)
        elif params.temperature > 0:
            # a row that is not finite fails when read; until then it draws from finite numbers (a device-side
            # check of the distribution would end the whole process)
            z = torch.where(finite[row], logits[row], 0.0)
            probabilities = _filtered_rows(z[None], [params])[0].softmax(-1)
            tokens[row] = torch.multinomial(probabilities, 1, generator=request.generator)[0]
    if shared:
        rows = torch.tensor(shared, device=logits.device)
        z = torch.where(finite[rows][:, None], logits[rows], 0.0)
        probabilities = _filtered_rows(z, [requests[row].params for row in shared]).softmax(-1)
        tokens[rows] = torch.multinomial(probabilities, 1)[:, 0]
    logprob_rows = {row: i for i, row in enumerate(r for r, q in enumerate(requests) if q.params.logprobs is not None)}
    chosen = top = None
    if logprob_rows:
        rows = torch.tensor(list(logprob_rows), device=logits.device)
        logprobs = logits[rows].log_softmax(-1)                                            # [L, V]
        chosen = logprobs.gather(1, tokens[rows][:, None])[:, 0]                           # [L]
        most = max(requests[row].params.logprobs for row in logprob_rows)
        if most:
            top = torch.topk(logprobs, most)                                               # ([L, n], [L, n])
            top = (top.values, top.indices)
    return Launched(tokens, finite, logprob_rows, chosen, top)
