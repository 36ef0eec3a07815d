"""Blocks run whole (client/blocks.py, executor/store.py `GatedMlp`, `DecoderTail`): where the adapter leaves an MLP
frozen, the decoder layer's tail (o_proj, the residual, the norm, the MLP) is one executor call each way over tcp://
and nccl://, or the MLP alone where the tail may not run; training equals plain PEFT's in float64; an adapted MLP calls
its layers; a block call is checked like a layer call."""

from __future__ import annotations

import threading

import peft
import pytest
import torch
from peft import get_peft_model

import symbiosis
from helpers import assert_trains_as_plain_peft
from matrix import make_checkpoint, peft_config
from symbiosis.errors import BadCall, SymbiosisError
from symbiosis.transport.server import ExecutorServer


def _calls(executor, key: str) -> int:
    return executor.stats_snapshot()["per_layer"].get(key, {}).get("calls", 0)


def _pair(path, auto_class, backend, method: str):
    reference = auto_class.from_pretrained(path, dtype=torch.float64)
    split = symbiosis.from_pretrained(path, backend, auto_class=auto_class, dtype=torch.float64)
    models = []
    for model in (reference, split):
        torch.manual_seed(1234)
        models.append(get_peft_model(model, peft_config(method, "llama")))
    return models


@pytest.fixture
def backends(checkpoints, tmp_path):
    """transport -> (executor, what a client attaches to), servers stopped at teardown."""
    servers = []

    def make(transport: str):
        path, _ = checkpoints("llama")
        executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
        if transport == "in_process":
            executor.attach(executor.fingerprint, "bystander")  # no direct path: calls go to the executor
            return executor, executor
        url = f"ipc://{tmp_path}/blocks.sock" if transport == "ipc" else "tcp://127.0.0.1:0"
        servers.append(ExecutorServer(executor, url).start())
        url = servers[-1].url
        if transport == "gloo":  # nccl://'s twin on the CPU: tensors over torch.distributed point-to-point
            url = "gloo://127.0.0.1:" + url.rsplit(":", 1)[1]
        return executor, symbiosis.connect(url, timeout=20)

    yield make
    for server in servers:
        server.stop()


@pytest.mark.parametrize("transport", ["tcp", "gloo", "ipc", "in_process"])
def test_a_frozen_tail_is_one_call_each_way_and_trains_as_plain_peft(transport, backends, checkpoints):
    """Over tcp:// and nccl:// (gloo:// here) a decoder layer's o_proj, norm and frozen MLP are one call each way; in
    process and over ipc:// shared memory its layers are called (bytes cost little there, and a block's backward
    recomputes its forward)."""
    path, auto_class = checkpoints("llama")
    executor, backend = backends(transport)
    assert {"model.layers.0.mlp", "model.layers.0"} <= executor.block_specs.keys()
    reference, split = _pair(path, auto_class, backend, "lora")  # LoRA on attention only
    assert_trains_as_plain_peft(reference, split, "llama")
    whole = transport in ("tcp", "gloo")
    for layer in range(split.config.num_hidden_layers):  # three training passes
        tail = f"model.layers.{layer}"
        assert _calls(executor, f"{tail}:forward") == _calls(executor, f"{tail}:backward") == (3 if whole else 0)
        assert _calls(executor, f"{tail}.mlp:forward") == 0
        assert (_calls(executor, f"{tail}.self_attn.o_proj:forward") == 0) == whole
        assert (_calls(executor, f"{tail}.mlp.down_proj:forward") == 0) == whole


def _lora(**options):
    return peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, init_lora_weights=False, **options)


def _trains_over_tcp(executor, backend, path, auto_class, config, before_training=lambda model: None) -> None:
    models = []
    for model in (auto_class.from_pretrained(path, dtype=torch.float64),
                  symbiosis.from_pretrained(path, backend, auto_class=auto_class, dtype=torch.float64)):
        torch.manual_seed(1234)
        models.append(get_peft_model(model, config))
        before_training(models[-1])
    assert_trains_as_plain_peft(*models, "llama")


def test_a_lora_on_o_proj_adds_its_delta_to_the_residual_before_the_tail(backends, checkpoints):
    """The tenant's o_proj LoRA: its delta joins the residual stream the tail takes; numbers as plain PEFT's."""
    path, auto_class = checkpoints("llama")
    executor, backend = backends("tcp")
    _trains_over_tcp(executor, backend, path, auto_class,
                     _lora(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0))
    assert _calls(executor, "model.layers.0:backward") == 3
    assert _calls(executor, "model.layers.0.self_attn.o_proj:forward") == 0


@pytest.mark.parametrize("case", ["dora_on_o_proj", "trained_norm", "norm_written", "hooked_o_proj"])
def test_a_tail_that_may_not_run_whole_falls_back_to_its_mlp_block(case, backends, checkpoints):
    """DoRA rescales o_proj's sum; a trained norm (PEFT's `modules_to_save`) or one whose weight was written after
    the model was built is not the executor's; a hook on o_proj would see a stand-in: o_proj and the MLP block are
    called instead, numbers as plain PEFT's (the hook's too)."""
    path, auto_class = checkpoints("llama")
    executor, backend = backends("tcp")
    config = {"dora_on_o_proj": lambda: _lora(target_modules=["q_proj", "o_proj"], use_dora=True),
              "trained_norm": lambda: _lora(target_modules=["q_proj", "v_proj"],
                                            modules_to_save=["post_attention_layernorm"]),
              "norm_written": lambda: _lora(target_modules=["q_proj", "v_proj"]),
              "hooked_o_proj": lambda: _lora(target_modules=["q_proj", "v_proj"])}[case]()
    seen = []

    def written(model):
        if case == "norm_written":
            with torch.no_grad():
                model.get_submodule("base_model.model.model.layers.1.post_attention_layernorm").weight.mul_(1.5)
        if case == "hooked_o_proj":
            model.get_submodule("base_model.model.model.layers.1.self_attn.o_proj").register_forward_hook(
                lambda module, args, out: seen.append(out.detach().clone()))

    _trains_over_tcp(executor, backend, path, auto_class, config, written)
    if case == "hooked_o_proj":  # the reference's passes and ours, in turn
        assert len(seen) == 6 and seen[1].abs().max() > 0
        for theirs, ours in zip(seen[0::2], seen[1::2]):
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert _calls(executor, "model.layers.1:forward") == 0
    assert _calls(executor, "model.layers.1.mlp:forward") == 3
    assert _calls(executor, "model.layers.1.self_attn.o_proj:forward") == 3


def test_a_tail_whose_layer_skips_a_step_raises(backends, checkpoints):
    """A decoder layer whose forward does not take o_proj, the norm and the MLP in that order (here one that skips the
    post-attention norm) raises instead of returning a layer served by halves."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from symbiosis.client.blocks import _served_tail

    class Unnormed(LlamaDecoderLayer):
        def forward(self, hidden_states, **kwargs):
            attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
            hidden_states = hidden_states + attended
            return hidden_states + self.mlp(hidden_states)

    path, auto_class = checkpoints("llama")
    executor, backend = backends("tcp")
    model = symbiosis.from_pretrained(path, backend, auto_class=auto_class, dtype=torch.float64)
    model.model.layers[1].__class__ = _served_tail(Unnormed)
    with pytest.raises(SymbiosisError, match="called mlp out of the order"), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert model.model.layers[1].self_attn.o_proj.deferred is None  # nothing left armed


@pytest.mark.parametrize("arch", ["gemma2", "granite", "qwen2", "qwen3", "mistral"])
def test_every_gated_mlp_architecture_trains_as_plain_peft_whole(arch, checkpoints):
    """The other architectures whose MLP is served whole (their own activations: Gemma's tanh GELU), over tcp://; with
    their decoder layers' tails where those are Llama's (Qwen2, Qwen3, Mistral), not where norms or scales sit between
    (Gemma2, Granite)."""
    path, auto_class = checkpoints(arch)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    server = ExecutorServer(executor, "tcp://127.0.0.1:0").start()
    try:
        models = []
        for backend in (None, symbiosis.connect(server.url, timeout=20)):
            model = auto_class.from_pretrained(path, dtype=torch.float64) if backend is None else \
                symbiosis.from_pretrained(path, backend, auto_class=auto_class, dtype=torch.float64)
            torch.manual_seed(1234)
            models.append(get_peft_model(model, peft_config("lora", arch)))
        assert_trains_as_plain_peft(*models, arch)
        tails = {b for b, spec in executor.block_specs.items() if spec.kind == "decoder_tail"}
        assert bool(tails) == (arch in ("qwen2", "qwen3", "mistral"))
        for block in executor.block_specs:  # an MLP is called alone where its layer's tail is not served
            called = block in tails or f"{block.rpartition('.')[0]}" not in tails
            assert _calls(executor, f"{block}:backward") == (3 if called else 0), block
    finally:
        server.stop()


def test_a_checkpointed_client_recomputes_its_blocks(backends, checkpoints):
    """transformers' gradient checkpointing over tcp://: backward runs each decoder layer's forward again, its block
    call included; numbers as plain PEFT's without checkpointing."""
    path, auto_class = checkpoints("llama")
    executor, backend = backends("tcp")
    reference, split = _pair(path, auto_class, backend, "lora")
    split.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_trains_as_plain_peft(reference, split, "llama")
    assert _calls(executor, "model.layers.0:forward") == 6 and _calls(executor, "model.layers.0:backward") == 3


def test_a_trained_copy_of_an_mlp_calls_its_own_layers(backends, checkpoints):
    """PEFT's `modules_to_save` trains a deep copy of each MLP (its projections' weights fetched from the executor):
    the copy computes with its own weights, as plain PEFT's does; the frozen originals stay blocks."""
    path, auto_class = checkpoints("llama")
    executor, backend = backends("tcp")
    config = lambda: peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],  # noqa: E731
                                     modules_to_save=["mlp"], init_lora_weights=False)
    models = []
    for model in (auto_class.from_pretrained(path, dtype=torch.float64),
                  symbiosis.from_pretrained(path, backend, auto_class=auto_class, dtype=torch.float64)):
        torch.manual_seed(1234)
        models.append(get_peft_model(model, config()))
    assert_trains_as_plain_peft(*models, "llama")
    assert _calls(executor, "model.layers.0.mlp:forward") == 0  # the active copies ran in the client


def test_an_mlp_with_biases_is_served_whole_with_them(tmp_path):
    """Llama with `mlp_bias`: the block adds each projection's bias, as the layers do."""
    auto_class = make_checkpoint("llama", tmp_path, mlp_bias=True)
    executor = symbiosis.Executor.from_pretrained(tmp_path, dtype=torch.float64)
    assert executor.block_specs and executor.weights.layers["model.layers.0.mlp.down_proj"].bias is not None
    server = ExecutorServer(executor, "tcp://127.0.0.1:0").start()
    try:
        assert_trains_as_plain_peft(*_pair(tmp_path, auto_class, symbiosis.connect(server.url, timeout=20), "lora"),
                                    "llama")
        assert _calls(executor, "model.layers.0:forward") == 3  # its tail, the MLP's biases in it
    finally:
        server.stop()


def test_an_adapted_mlp_calls_its_layers(backends, checkpoints):
    """LoRA on an MLP projection: that MLP's layers are called one by one (its adapter is the client's); numbers as
    plain PEFT's."""
    path, auto_class = checkpoints("llama")
    executor, backend = backends("tcp")
    reference, split = _pair(path, auto_class, backend, "lora_attn_mlp")
    assert_trains_as_plain_peft(reference, split, "llama")
    assert _calls(executor, "model.layers.0.mlp:forward") == 0
    assert _calls(executor, "model.layers.0.mlp.down_proj:forward") > 0


@pytest.mark.parametrize("block", ["model.layers.0.mlp", "model.layers.0"])
def test_a_block_call_is_checked_as_a_layer_call(block, backends):
    """Its forward takes [T, in] ([x] for an MLP, [h | a] for a tail); its backward [x | g], [T, in + out]; it has no
    bias-free forward. The executor refuses other shapes before anything is queued, and a remote session before
    anything is sent."""
    executor, remote = backends("tcp")
    spec = executor.block_specs[block]
    session = executor.attach(executor.fingerprint, "probe")
    remote_session = remote.attach(executor.fingerprint, "probe")
    x = torch.randn(3, spec.in_features, dtype=torch.float64)
    g = torch.randn(3, spec.out_features, dtype=torch.float64)
    for one in (session, remote_session):
        assert one.forward(block, x).shape == (3, spec.out_features)
        assert one.backward(block, torch.cat([x, g], dim=1)).shape == (3, spec.in_features)
        with pytest.raises(BadCall, match=r"expects \[tokens, %d\]" % (spec.in_features + spec.out_features)):
            one.backward(block, x)
        with pytest.raises(BadCall, match="forward and backward only"):
            one.forward_nobias(block, x)
    remote_session.close()
    session.close()


def test_a_tails_backward_is_its_forwards_gradient(backends):
    """The executor's tail, d = o(a) + mlp(norm(h + o(a))), against torch's autograd of the same composition of its
    base layers in float64 (the model's own norm and activation)."""
    executor, _ = backends("tcp")
    tail = executor.weights.blocks["model.layers.0"]
    hidden, attention = tail.o_proj.spec.out_features, tail.o_proj.spec.in_features
    h = torch.randn(5, hidden, dtype=torch.float64, requires_grad=True)
    a = torch.randn(5, attention, dtype=torch.float64, requires_grad=True)
    layers = executor.weights.layers
    o = a @ layers["model.layers.0.self_attn.o_proj"].weight.T
    normed = tail.norm(h + o)
    gate = normed @ layers["model.layers.0.mlp.gate_proj"].weight.T
    up = normed @ layers["model.layers.0.mlp.up_proj"].weight.T
    d = o + (tail.mlp.act(gate) * up) @ layers["model.layers.0.mlp.down_proj"].weight.T
    g = torch.randn_like(d)
    grad_h, grad_a = torch.autograd.grad(d, (h, a), g)
    x = torch.cat([h, a], dim=1).detach()
    torch.testing.assert_close(tail.forward(x), d.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tail.backward(torch.cat([x, g], dim=1)), torch.cat([grad_h, grad_a], dim=1),
                               rtol=1e-12, atol=1e-12)


def test_two_tenants_tail_calls_batched_get_their_own_results(checkpoints):
    """Tails of two clients run as one batch (lockstep): the norm and the MLP act row by row, so each client's rows
    come back as its call alone computes them, forward and backward, and a NaN in one client's rows stays in them."""
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="lockstep")
    tail = "model.layers.1"
    spec = executor.block_specs[tail]
    sessions = [executor.attach(executor.fingerprint, f"tenant{i}") for i in range(2)]
    inputs = [torch.randn(rows, spec.in_features, dtype=torch.float64) for rows in (3, 5)]
    inputs[1][2, 0] = float("nan")
    grads = [torch.randn(x.shape[0], spec.out_features, dtype=torch.float64) for x in inputs]
    block = executor.weights.blocks[tail]
    alone = [(block.forward(x), block.backward(torch.cat([x, g], dim=1))) for x, g in zip(inputs, grads)]
    results, start = {}, threading.Barrier(2)

    def run(i):
        start.wait()
        results[i] = (sessions[i].forward(tail, inputs[i]),
                      sessions[i].backward(tail, torch.cat([inputs[i], grads[i]], dim=1)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, (forward, backward) in enumerate(alone):
        torch.testing.assert_close(results[i][0], forward, equal_nan=True)
        torch.testing.assert_close(results[i][1], backward, equal_nan=True)
    assert torch.isfinite(results[0][0]).all() and torch.isfinite(results[0][1]).all()  # the NaN stayed in tenant 1's
    assert not torch.isfinite(results[1][0][2]).all()
    assert executor.stats_snapshot()["overall"]["max_batch_calls"] >= 2
    for session in sessions:
        session.close()
