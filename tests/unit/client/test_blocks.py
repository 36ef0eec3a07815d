"""Gated MLPs run whole (client/blocks.py, executor/store.py `GatedMlp`): where the adapter leaves an MLP frozen it is
one executor call each way, over every transport, and training equals plain PEFT's in float64; an adapted MLP calls
its layers; a block call is checked like a layer call."""

from __future__ import annotations

import peft
import pytest
import torch
from peft import get_peft_model

import symbiosis
from helpers import assert_trains_as_plain_peft
from matrix import make_checkpoint, peft_config
from symbiosis.errors import BadCall
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
def test_a_frozen_mlp_is_one_call_each_way_and_trains_as_plain_peft(transport, backends, checkpoints):
    """Over tcp:// and nccl:// (gloo:// here) a frozen MLP is one call each way; in process and over ipc:// shared
    memory its layers are called (bytes cost little there, and a block's backward recomputes gate and up)."""
    path, auto_class = checkpoints("llama")
    executor, backend = backends(transport)
    assert "model.layers.0.mlp" in executor.block_specs
    reference, split = _pair(path, auto_class, backend, "lora")  # LoRA on attention only
    assert_trains_as_plain_peft(reference, split, "llama")
    whole = transport in ("tcp", "gloo")
    for layer in range(split.config.num_hidden_layers):  # three training passes
        block = f"model.layers.{layer}.mlp"
        assert _calls(executor, f"{block}:forward") == _calls(executor, f"{block}:backward") == (3 if whole else 0)
        assert (_calls(executor, f"{block}.down_proj:forward") == 0) == whole


@pytest.mark.parametrize("arch", ["gemma2", "granite", "qwen2", "qwen3", "mistral"])
def test_every_gated_mlp_architecture_trains_as_plain_peft_whole(arch, checkpoints):
    """The other architectures whose MLP is served whole (their own activations: Gemma's tanh GELU), over tcp://."""
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
        assert executor.block_specs and all(_calls(executor, f"{block}:backward") == 3 for block in executor.block_specs)
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
    assert _calls(executor, "model.layers.0.mlp:forward") == 6 and _calls(executor, "model.layers.0.mlp:backward") == 3


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
        assert _calls(executor, "model.layers.0.mlp:forward") == 3
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


def test_a_block_call_is_checked_as_a_layer_call(backends):
    """Its forward takes [T, hidden]; its backward [x | g], [T, 2 * hidden]; it has no bias-free forward. The
    executor refuses other shapes before anything is queued, and a remote session before anything is sent."""
    executor, remote = backends("tcp")
    block = "model.layers.0.mlp"
    hidden = executor.block_specs[block].in_features
    session = executor.attach(executor.fingerprint, "probe")
    remote_session = remote.attach(executor.fingerprint, "probe")
    x = torch.randn(3, hidden, dtype=torch.float64)
    for one in (session, remote_session):
        assert one.forward(block, x).shape == (3, hidden)
        assert one.backward(block, torch.cat([x, x], dim=1)).shape == (3, hidden)
        with pytest.raises(BadCall, match=r"expects \[tokens, %d\]" % (2 * hidden)):
            one.backward(block, x)
        with pytest.raises(BadCall, match="forward and backward only"):
            one.forward_nobias(block, x)
    remote_session.close()
    session.close()
