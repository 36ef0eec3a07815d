"""Mixture-of-experts models on a split model: each expert's projections are base layers of the executor (one
copy of every expert, views of transformers' fused tensors), the router and the routing are the client's.
Exact against plain transformers (its eager experts) + PEFT in float64: logits, loss with the router's auxiliary
loss, every adapter gradient, 3 AdamW steps; greedy generation identical."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import matrix
import symbiosis
from helpers import assert_close, assert_trains_as_plain_peft, batch
from matrix import peft_config
from symbiosis.client.virtual import VirtualWeight


def moe_pair(arch, method, checkpoints, executors):
    path, auto_class = checkpoints(arch)
    # transformers' default experts kernel (grouped_mm) has no float64; its eager loop is the reference
    reference = auto_class.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    split = symbiosis.from_pretrained(path, executors(arch), auto_class=auto_class, dtype=torch.float64)
    models = []
    for model in (reference, split):
        torch.manual_seed(1234)
        models.append(get_peft_model(model, peft_config(method, arch)))
    return tuple(models)


@pytest.mark.parametrize("arch,method", [(a, m) for a in matrix.MOE for m in matrix.MOE_METHODS])
def test_split_moe_trains_as_plain_peft(arch, method, checkpoints, executors):
    reference, split = moe_pair(arch, method, checkpoints, executors)
    assert_trains_as_plain_peft(reference, split, arch)


@pytest.mark.parametrize("arch", matrix.MOE)
def test_router_auxiliary_loss_and_its_gradient_match(arch, checkpoints, executors):
    reference, split = moe_pair(arch, "lora_router", checkpoints, executors)
    outputs = []
    for model in (reference, split):
        model.train()
        out = model(**batch(arch))
        assert out.aux_loss is not None and out.aux_loss > 0
        out.aux_loss.backward()  # reaches the router's LoRA only
        outputs.append((out, {n: p.grad for n, p in model.named_parameters() if "gate.lora" in n}))
    (ref_out, ref_grads), (our_out, our_grads) = outputs
    assert_close(our_out.aux_loss, ref_out.aux_loss, "router auxiliary loss")
    assert ref_grads and ref_grads.keys() == our_grads.keys()
    for name in ref_grads:
        assert_close(our_grads[name], ref_grads[name], f"aux-loss gradient of {name}")


@pytest.mark.parametrize("arch", matrix.MOE)
def test_greedy_generation_is_identical(arch, checkpoints, executors):
    reference, split = moe_pair(arch, "lora_router", checkpoints, executors)
    prompt = batch(arch)
    kwargs = dict(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=6,
                  do_sample=False, pad_token_id=0,
                  output_router_logits=False)  # transformers' aux loss fails in generate (mask vs one new token)
    assert torch.equal(split.generate(**kwargs), reference.generate(**kwargs))


@pytest.mark.parametrize("arch", matrix.MOE)
def test_client_holds_no_expert_and_the_executor_each_expert_once(arch, checkpoints, executors):
    path, auto_class = checkpoints(arch)
    executor = executors(arch)
    split = symbiosis.from_pretrained(path, executor, auto_class=auto_class, dtype=torch.float64)
    plain = auto_class.from_pretrained(path, dtype=torch.float64)
    expert_names = [n for n, p in plain.named_parameters() if p.dim() == 3]
    assert expert_names, "the tiny model has no fused experts"
    ours = dict(split.named_parameters())
    for name in expert_names:  # same names and shapes as transformers', but no values on the client
        assert isinstance(ours[name], VirtualWeight) and ours[name].shape == plain.get_parameter(name).shape
    real = sum(p.numel() for p in split.parameters() if not isinstance(p, VirtualWeight))
    assert real < sum(plain.get_parameter(n).numel() for n in expert_names) / 4

    experts = [layer for layer in executor.weights.layers.values() if layer.spec.expert is not None]
    assert len(experts) == sum(plain.get_parameter(n).shape[0] for n in expert_names)
    by_tensor = {}
    for layer in experts:  # every expert a view of its one fused tensor
        by_tensor.setdefault(layer.spec.weight_name, set()).add(layer.weight.untyped_storage().data_ptr())
    assert len(by_tensor) == len(expert_names) and all(len(ptrs) == 1 for ptrs in by_tensor.values())
    base_bytes = sum(p.numel() * 8 for n, p in plain.named_parameters()
                     if p.dim() == 3 or n.endswith(("proj.weight", "lm_head.weight")))
    assert executor.weights.nbytes == base_bytes  # nothing held twice
    # and the executor refuses to fuse experts into a group (which would copy them)
    ids = [layer.spec.layer_id for layer in experts[:2]]
    assert executor.weights.get("+".join(ids)) is None


@pytest.mark.parametrize("arch", matrix.MOE)
def test_lora_on_the_experts_themselves_is_refused_clearly(arch, checkpoints, executors):
    path, auto_class = checkpoints(arch)
    split = symbiosis.from_pretrained(path, executors(arch), auto_class=auto_class, dtype=torch.float64)
    before = {name: type(module) for name, module in split.named_modules()}
    for config in (LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"]),
                   LoraConfig(r=4, target_modules="all-linear")):  # PEFT adds the experts to "all-linear" on MoE
        with pytest.raises(symbiosis.UnsupportedAdapter, match=r"target_parameters.*experts\.(gate_up|down)_proj"):
            get_peft_model(split, config)
        assert {name: type(module) for name, module in split.named_modules()} == before  # nothing injected


def test_each_expert_is_a_call_batched_with_other_clients(checkpoints, executors):
    """An expert's tokens travel as one call per projection, under the expert's own layer id, so the executor's
    batcher groups two clients' calls for one expert as it does for one dense layer."""
    path, auto_class = checkpoints("mixtral")
    executor = executors("mixtral")
    split = symbiosis.from_pretrained(path, executor, auto_class=auto_class, dtype=torch.float64)
    before = executor.stats_snapshot()["per_layer"]
    with torch.no_grad():
        split(**{k: v for k, v in batch("mixtral").items() if k != "labels"})
    after = executor.stats_snapshot()["per_layer"]
    called = {key for key in after if after[key]["calls"] > before.get(key, {"calls": 0})["calls"]}
    expert_calls = {key for key in called if ".experts." in key}
    assert any(key.endswith(".0:forward") for key in expert_calls)
    assert all(key.split(":")[0] in executor.weights.layers for key in expert_calls)
