"""Call grouping: layers that take one input (q/k/v, gate/up) become one executor call, exactly."""

from __future__ import annotations

import torch
from peft import get_peft_model

import symbiosis
from symbiosis.client.grouping import CallGrouper
from symbiosis.transport.server import ExecutorServer
from helpers import assert_close, batch, train_step
from matrix import peft_config


def test_grouped_calls_are_exact_and_fewer(checkpoints):
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    server = ExecutorServer(executor, "tcp://127.0.0.1:*").start()
    try:
        torch.manual_seed(1)
        split = get_peft_model(symbiosis.from_pretrained(path, symbiosis.connect(server.url)),
                               peft_config("lora", "llama"))
        torch.manual_seed(1)
        plain = get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64), peft_config("lora", "llama"))
        for model in (split, plain):
            model.train()
        train_step(split, "llama", 0)  # the first pass teaches the grouper
        before = executor.stats_snapshot()["overall"]["calls"]
        for step in (1, 2):
            split.zero_grad()
            plain.zero_grad()
            ours, theirs = train_step(split, "llama", step), train_step(plain, "llama", step)
            assert_close(ours.logits, theirs.logits, f"logits {step}")
            for (name, p), (_, q) in zip(split.named_parameters(), plain.named_parameters()):
                if p.requires_grad:
                    assert_close(p.grad, q.grad, f"{name} {step}")
        per_pass = (executor.stats_snapshot()["overall"]["calls"] - before) / 2
        layers = split.config.num_hidden_layers
        # Forward: q+k+v and the decoder layer's tail (o_proj, its norm and the MLP whole: the adapter leaves
        # them frozen, client/blocks.py) per layer, and lm_head. Backward: the same, less layer 0's q+k+v, whose
        # input (the frozen embedding's) needs no gradient. Ungrouped and layer by layer: 7 per layer each way.
        assert per_pass == (2 * layers + 1) + (2 * layers)
        per_layer = executor.stats_snapshot()["per_layer"]
        qkv = "+".join(f"model.layers.0.self_attn.{n}_proj" for n in "qkv")
        # (the group once learnt, in the last two passes; the tail from the first pass on: nothing to learn)
        assert per_layer[f"{qkv}:forward"]["calls"] == 2 and per_layer["model.layers.1:backward"]["calls"] == 3
        # The fused weight is made once; the members now view it (no extra memory).
        fused = executor.weights.get(qkv)
        q = executor.weights.layers["model.layers.0.self_attn.q_proj"].weight
        assert q.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()

        # Greedy generation through grouped calls equals plain generation.
        split.eval()
        plain.eval()
        prompt = batch("llama")
        kwargs = dict(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=5,
                      do_sample=False, pad_token_id=0)
        assert torch.equal(split.generate(**kwargs), plain.generate(**kwargs))
    finally:
        server.stop()


class _FakeSession:
    def __init__(self, weights):
        self.weights = weights
        self.layer_specs = {k: type("Spec", (), {"out_features": w.shape[0]}) for k, w in weights.items()}
        self.calls = []

    def call(self, tokens, layer_id, inference):
        self.calls.append(layer_id)
        return tokens @ torch.cat([self.weights[i] for i in layer_id.split("+")]).T


def test_a_member_fed_another_input_gets_its_own_call_and_the_group_is_forgotten():
    weights = {name: torch.randn(3, 4, dtype=torch.float64) for name in "abc"}
    session = _FakeSession(weights)
    grouper = CallGrouper(session, session.call)
    x = torch.randn(2, 4, dtype=torch.float64)
    for name in "abc":  # learn: a, b take x; c takes something else
        grouper.call(name, x if name != "c" else x + 1, x if name != "c" else x + 1, False)
    grouper.call("c", x + 2, x + 2, False)  # ends the run: group (a, b) is recorded
    assert grouper.groups == {"a": ("a", "b")}
    session.calls.clear()
    y = torch.randn(2, 4, dtype=torch.float64)
    assert torch.allclose(grouper.call("a", y, y, False), y @ weights["a"].T)
    assert torch.allclose(grouper.call("b", y, y, False), y @ weights["b"].T)
    assert session.calls == ["a+b"]
    z, other = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    grouper.call("a", z, z, False)
    assert torch.allclose(grouper.call("b", other, other, False), other @ weights["b"].T)  # not a's input
    assert session.calls == ["a+b", "a+b", "b"] and grouper.groups == {}
