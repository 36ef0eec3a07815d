"""Every tenant's optimizer step of a round taken together (`step_together`): each adapter moves exactly as its own
`torch.optim.AdamW` after `clip_grad_norm_` moves it alone, whatever the others' hyperparameters, step counts, or
whether they have gradients at all."""

from __future__ import annotations

import pytest
import torch

from symbiosis.train.lora import AdamParams, HostedLora, LoraSpec, TargetLayer, step_together

TARGETS = [TargetLayer("model.layers.0.self_attn.q_proj", "0.q", "attn", 6, 4),
           TargetLayer("model.layers.0.mlp.up_proj", "0.up", "mlp", 6, 10)]


def _reference_step(parameters, optimizer, adam: AdamParams) -> float:
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if adam.grad_clip_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(grads, adam.grad_clip_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
    for group in optimizer.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def test_steps_taken_together_equal_each_adapters_own_adamw():
    generator = torch.Generator().manual_seed(0)
    loras = [HostedLora(LoraSpec(rank=r, seed=i), TARGETS, torch.device("cpu"), torch.float64)
             for i, r in enumerate((2, 4, 3))]
    references = []
    for lora in loras:
        parameters = [p.detach().clone().requires_grad_() for p in lora.parameters()]
        references.append((parameters, torch.optim.AdamW(parameters, lr=0.0)))
    adams = [AdamParams(1e-2, grad_clip_norm=0.5), AdamParams(3e-3, beta1=0.8, beta2=0.99, eps=1e-8,
                                                               weight_decay=0.1), AdamParams(1e-2, grad_clip_norm=0.5)]
    for round_ in range(4):
        stepping = [i for i in range(3) if not (round_ == 1 and i == 2)]  # adapter 2 skips a round: counts differ
        for i in stepping:
            with_grads = not (round_ == 2 and i == 1)  # a step with no gradients since the last one
            for ours, theirs in zip(loras[i].parameters(), references[i][0]):
                grad = torch.randn(ours.shape, generator=generator, dtype=torch.float64) * (3.0 if i == 0 else 1.0)
                if with_grads:  # as a pass leaves them: added into the adapter's flat gradient
                    ours.grad.add_(grad)
                theirs.grad = grad.clone() if with_grads else None
            loras[i].pending = with_grads
        metrics = step_together([(loras[i], adams[i]) for i in stepping])
        for i, metric in zip(stepping, metrics):
            expected_norm = _reference_step(references[i][0], references[i][1], adams[i])
            assert metric["grad_norm:mean"] == pytest.approx(expected_norm, rel=1e-12, abs=1e-12)
            assert metric["learning_rate:mean"] == adams[i].learning_rate
    for lora, (parameters, optimizer) in zip(loras, references):
        moments = dict(zip(("exp_avg", "exp_avg_sq"), lora.moments()))
        for (name, ours), theirs in zip(lora.named_tensors().items(), parameters):
            # the clipping factor comes from the flat gradient's norm: clip_grad_norm_'s up to rounding
            torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-14, atol=1e-15)
            assert not ours.grad.any() and ours.grad.data_ptr() >= lora.flat_grad.data_ptr(), \
                "cleared, and still a view of the flat gradient"
            for key, flat in moments.items():
                mine = flat[lora._named_slices()[name]].view(ours.shape)
                torch.testing.assert_close(mine, optimizer.state[theirs][key], rtol=1e-14, atol=1e-15)
            assert float(optimizer.state[theirs]["step"]) == lora.steps
    assert [lora.steps for lora in loras] == [4, 3, 3], "a step without gradients moves nothing and is not counted"


def test_adam_params_come_from_the_requests_fields_with_tinkers_defaults():
    assert AdamParams.from_fields({"learning_rate": "0.5"}) == AdamParams(0.5)
    assert AdamParams.from_fields({}) == AdamParams(1e-4)
    with pytest.raises(ValueError):
        AdamParams.from_fields({"beta1": "fast"})
    for fields, named in (({"beta2": 1.0}, "beta2"), ({"learning_rate": float("nan")}, "learning_rate"),
                          ({"eps": -1}, "eps"), ({"grad_clip_norm": float("inf")}, "grad_clip_norm")):
        with pytest.raises(ValueError, match=named):
            AdamParams.from_fields(fields)
