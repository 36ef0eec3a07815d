"""Sampling (engine/sampling.py): the rows of requests without a seed are filtered and drawn together, each with
its own temperature, top_k and top_p, exactly as one row alone is filtered; seeded rows keep their own generator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from symbiosis.engine import sampling
from symbiosis.engine.params import SamplingParams

VOCABULARY = 50
PARAMS = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
          SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.5, top_k=7, top_p=0.6),
          SamplingParams(temperature=2.0, top_k=VOCABULARY + 3), SamplingParams(temperature=0.9, top_k=1),
          SamplingParams(temperature=1.1, top_p=0.01), SamplingParams(temperature=1.0, top_p=1e-9)]


def _one_row(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference: one row, its parameters as numbers, as transformers' temperature, top-k and top-p warpers."""
    z = logits / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        z = z.masked_fill(z < torch.topk(z, params.top_k).values[-1], float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(z)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - params.top_p
        drop[-1] = False  # the most likely token always stays
        z = z.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return z


def _request(params, seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SimpleNamespace(params=params, generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_filtered_together_are_each_row_filtered_alone(dtype):
    logits = torch.randn(len(PARAMS), VOCABULARY, generator=torch.Generator().manual_seed(0), dtype=dtype) * 3
    together = sampling._filtered_rows(logits, PARAMS)
    for row, params in enumerate(PARAMS):
        alone = _one_row(logits[row], params)
        assert torch.equal(together[row].isinf(), alone.isinf()), params
        assert torch.equal(together[row], alone), params


def test_unseeded_rows_draw_from_their_own_kept_tokens_and_seeded_rows_as_alone():
    logits = torch.randn(6, VOCABULARY, generator=torch.Generator().manual_seed(1)) * 3
    logits[4, 7] = float("nan")  # fails when read; the others are not disturbed
    requests = [_request(SamplingParams(temperature=0.9, top_k=1)), _request(SamplingParams(temperature=0.0)),
                _request(SamplingParams(temperature=1.2, top_p=0.01)), _request(SamplingParams(temperature=0.8), seed=7),
                _request(SamplingParams(temperature=1.0)), _request(SamplingParams(temperature=1.0, top_k=3))]
    choices = sampling.launch(logits, requests).read(requests)
    best = logits.argmax(-1)
    assert [choices[row].token for row in (0, 1, 2)] == [best[0], best[1], best[2]]
    alone = sampling.launch(logits[3:4], [_request(SamplingParams(temperature=0.8), seed=7)])
    assert choices[3].token == alone.read([requests[3]])[0].token
    assert choices[4] is None
    assert choices[5].token in logits[5].topk(3).indices.tolist()


def test_unseeded_rows_drawn_together_follow_each_rows_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]] * 2)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=2)]
    requests = [_request(p) for p in params] * 2000  # 4,000 rows: each params 2,000 draws
    tokens = torch.tensor([c.token for c in sampling.launch(logits.repeat(2000, 1), requests).read(requests)])
    top_two = torch.zeros(4)
    top_two[1:3] = torch.tensor([1.0, 2.0]).div(0.5).softmax(-1)  # top_k 2 keeps tokens 1 and 2
    for offset, (p, expected) in enumerate([(params[0], logits[0].softmax(-1)), (params[1], top_two)]):
        frequencies = torch.bincount(tokens[offset::2], minlength=4).double() / 2000
        assert torch.allclose(frequencies, expected.double(), atol=0.04), (p, frequencies, expected)
