"""Split execution equals plain transformers+PEFT in float64: logits, loss, every trainable gradient, and the
adapter weights after 3 AdamW steps, for every architecture tests/ builds x every core PEFT method that PEFT
itself supports (tests/matrix.py; the other PEFT tuner types: test_peft_support.py)."""

from __future__ import annotations

import peft
import pytest
import torch
from peft import get_peft_model, get_peft_model_state_dict

import matrix
import symbiosis
from conftest import VOCAB
from matrix import SEQ_CLS

RTOL = 1e-9
# transformers' eager Gemma2 attention yields NaN for a whole left-padded row in float64 (plain model too).
NAN_WHEN_PADDED_IN_FP64 = {"gemma2"}


def peft_config(method: str, arch: str):
    return matrix.core_config(arch, method)


def batch(arch: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    if arch not in NAN_WHEN_PADDED_IN_FP64:
        mask[0, :3] = 0  # left padding in one row: masks must flow through the split model too
    labels = torch.randint(0, 3, (3,), generator=g) if arch in SEQ_CLS else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


ATOL = 1e-14  # float64 rounding of a quantity that is zero in exact arithmetic (a key bias's gradient: softmax
# ignores a shift shared by all keys), where a relative error means nothing; the tensors here are of order 1


def assert_close(ours: torch.Tensor, reference: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    assert ours.shape == reference.shape, what
    assert not reference.isnan().any(), f"{what}: the reference itself is NaN"
    scale = reference.abs().max().item()
    err = (ours - reference).abs().max().item()
    assert err <= max(rtol * scale, ATOL), f"{what}: max abs error {err:.3e}, scale {scale:.3e}"


@pytest.fixture(scope="module")
def executors(checkpoints):
    made = {}

    def get(arch):
        if arch not in made:
            path, _ = checkpoints(arch)
            made[arch] = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
            # A second attached client: every call then takes the executor path (autograd Function, batcher),
            # not the single-client direct path, which test_single_client_direct_path covers.
            made[arch].attach(made[arch].fingerprint, "bystander")
        return made[arch]

    return get


def build_pair(arch, method, checkpoints, executors, make_config=None, prepare=None, base_config=None):
    """(reference PeftModel on the full model, symbiosis PeftModel on the split model), same adapter init.
    `make_config` (default: the core method's), `prepare(peft_model)`, `base_config`: model config settings."""
    make_config = make_config or (lambda: peft_config(method, arch))
    path, auto_class = checkpoints(arch)
    reference = auto_class.from_pretrained(path, dtype=torch.float64)
    split = symbiosis.from_pretrained(path, executors(arch), auto_class=auto_class, dtype=torch.float64)
    models = []
    for model in (reference, split):
        for key, value in (base_config or {}).items():
            setattr(model.config, key, value)
        torch.manual_seed(1234)
        model = get_peft_model(model, make_config())
        if prepare is not None:
            prepare(model)
        models.append(model)
    return tuple(models)


def assert_trains_as_plain_peft(reference, split, arch: str, extra=lambda batch: {}, rtol: float = RTOL) -> None:
    """One training step (logits, loss, every trainable gradient), then three AdamW steps (the adapters)."""
    for model in (reference, split):
        model.train()
    ref_out, our_out = train_step(reference, arch, 0, extra), train_step(split, arch, 0, extra)
    assert_close(our_out.logits, ref_out.logits, "logits", rtol)
    assert_close(our_out.loss, ref_out.loss, "loss", rtol)
    ref_params = dict(reference.named_parameters())
    trainable = [(n, p) for n, p in split.named_parameters() if p.requires_grad]
    assert trainable and {n for n, _ in trainable} == {n for n, p in ref_params.items() if p.requires_grad}
    for name, param in trainable:
        assert (param.grad is None) == (ref_params[name].grad is None), f"gradient of {name} reached one side only"
        if param.grad is not None:
            assert_close(param.grad, ref_params[name].grad, f"grad of {name}", rtol)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for _, p in trainable), "no adapter gradient at all"

    adalora = isinstance(split.peft_config[split.active_adapter], peft.AdaLoraConfig)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                  for m in (reference, split)]
    for step in range(3):
        for model, optimizer in zip((reference, split), optimizers):
            if step:
                train_step(model, arch, step, extra)
            optimizer.step()
            if adalora:  # AdaLoRA reallocates ranks after each step
                model.base_model.update_and_allocate(step)
            optimizer.zero_grad()
    ours, theirs = get_peft_model_state_dict(split), get_peft_model_state_dict(reference)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert_close(ours[key], theirs[key], f"adapter tensor {key} after 3 AdamW steps", rtol)


def train_step(model, arch: str, step: int, extra=lambda batch: {}) -> torch.Tensor:
    torch.manual_seed(100 + step)  # identical dropout masks on both sides
    inputs = batch(arch, seed=step)
    out = model(**inputs, **extra(inputs))
    out.loss.backward()
    return out


def saved_for_backward(model, arch: str):
    """(output of a training forward, bytes of the tensors autograd saved for backward meanwhile)."""
    saved = 0

    def count(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(100)
    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        out = model(**batch(arch))
    return out, saved


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
