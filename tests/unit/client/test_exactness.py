"""Split execution equals plain transformers+PEFT in float64: logits, loss, every trainable gradient, and the
adapter weights after 3 AdamW steps, for every architecture tests/ builds x every core PEFT method that PEFT
itself supports (tests/matrix.py; the other PEFT tuner types: test_peft_support.py)."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

import matrix
import symbiosis
from helpers import assert_close, assert_trains_as_plain_peft, batch, build_pair, saved_for_backward, train_step
from matrix import peft_config

@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_activation_checkpointing_is_exact_and_saves_a_fraction(arch, reentrant, checkpoints, executors):
    """transformers' gradient checkpointing on a split model: backward recomputes each decoder layer's
    forward (its executor calls included); loss and every adapter gradient equal plain PEFT's without
    checkpointing, and the client keeps a fraction of the activations for backward (what caps how many
    tenants fit next to one base)."""
    reference, split = build_pair(arch, "rslora_all_linear", checkpoints, executors)
    split.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for model in (reference, split):
        model.train()
    (ref_out, ref_saved), (our_out, our_saved) = saved_for_backward(reference, arch), saved_for_backward(split, arch)
    assert our_saved < ref_saved / 4, f"checkpointed split model saved {our_saved} bytes, plain PEFT {ref_saved}"
    ref_out.loss.backward()
    our_out.loss.backward()
    assert_close(our_out.loss, ref_out.loss, "loss")
    ref_params = dict(reference.named_parameters())
    for name, param in split.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, ref_params[name].grad, f"grad of {name}")


RUN = [(arch, method) for arch in matrix.ARCHS for method in matrix.CORE_METHODS
       if (arch, method) not in matrix.PEFT_CANNOT]


@pytest.mark.parametrize("arch,method", RUN)
def test_split_equals_plain_peft(arch, method, checkpoints, executors):
    assert_trains_as_plain_peft(*build_pair(arch, method, checkpoints, executors), arch)


@pytest.mark.parametrize("arch,method", sorted(matrix.PEFT_CANNOT))
def test_plain_peft_itself_refuses_what_the_matrix_leaves_out(arch, method, checkpoints):
    """The README says these pairs are PEFT's limits, not ours: plain PEFT must refuse them."""
    path, auto_class = checkpoints(arch)
    with pytest.raises((ValueError, TypeError, NotImplementedError)):
        model = get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64), peft_config(method, arch))
        model(**batch(arch))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "gpt_neox"])
def test_greedy_generate_matches(arch, checkpoints, executors):
    reference, split = build_pair(arch, "lora", checkpoints, executors)
    prompt = batch(arch)
    kwargs = dict(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=6,
                  do_sample=False, pad_token_id=0)
    assert torch.equal(split.generate(**kwargs), reference.generate(**kwargs))


@pytest.mark.parametrize("method", ["lora", "dora_rslora_dropout_bias"])
def test_single_client_direct_path(method, checkpoints):
    """Alone on an in-process executor, a client runs the executor's GEMMs itself with native autograd; the
    numbers are the same, and no activation is saved for base layers."""
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    model = symbiosis.from_pretrained(path, executor, auto_class=auto_class)
    torch.manual_seed(1234)
    split = get_peft_model(model, peft_config(method, "llama"))
    layer = split.base_model.model.model.layers[0].mlp.up_proj
    layer = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer  # all-linear wraps it
    assert layer.session.direct(layer.layer_id, torch.zeros(1, 64, dtype=torch.float64)) is not None
    reference = auto_class.from_pretrained(path, dtype=torch.float64)
    torch.manual_seed(1234)
    reference = get_peft_model(reference, peft_config(method, "llama"))
    calls = lambda: executor.stats_snapshot()["per_layer"]["model.layers.0.mlp.up_proj:forward"]["calls"]  # noqa: E731
    before = calls()
    ours, theirs = train_step(split, "llama", 0), train_step(reference, "llama", 0)
    # counted by the executor; DoRA with dropout also calls for x W^T of the dropped input and for A W^T
    assert calls() == before + {"lora": 1, "dora_rslora_dropout_bias": 3}[method]
    assert_close(ours.logits, theirs.logits, "logits")
    reference_params = dict(reference.named_parameters())
    for name, param in split.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, reference_params[name].grad, name)
    up = executor.weights.layers["model.layers.0.mlp.up_proj"].weight
    assert not up.requires_grad and up.grad is None
    x = torch.randn(2, 5, 64, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    activation = x.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != activation for t in saved), "the base layer saved its input"
    assert all(t.untyped_storage().data_ptr() == up.untyped_storage().data_ptr() for t in saved), \
        "the base layer saved something besides its frozen weight"
    assert_close(x.grad, torch.ones(2, 5, up.shape[0], dtype=torch.float64) @ up, "input gradient")
