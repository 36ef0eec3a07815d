"""Bad input gets a clear error naming the problem, and the executor keeps serving everyone else."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import symbiosis
from symbiosis.errors import BadCall, CheckpointError, FingerprintMismatch, UnknownClient, UnknownLayer
from conftest import make_checkpoint


@pytest.fixture
def llama(tmp_path):
    path = tmp_path / "llama"
    auto_class = make_checkpoint("llama", path)
    return path, auto_class


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        symbiosis.Executor.from_pretrained(tmp_path / "nope")


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="no config.json"):
        symbiosis.Executor.from_pretrained(tmp_path)


def test_config_without_weights(llama):
    path, _ = llama
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        symbiosis.Executor.from_pretrained(path)


def test_corrupt_config(llama):
    path, _ = llama
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        symbiosis.Executor.from_pretrained(path)


def test_corrupt_header(llama):
    path, _ = llama
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        symbiosis.Executor.from_pretrained(path)
    (path / "model.safetensors").write_bytes(data[:8] + b"\xff" * 16 + data[24:])
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        symbiosis.Executor.from_pretrained(path)


def test_truncated_file_names_the_tensor(llama):
    path, _ = llama
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated: tensor '.*' ends at byte"):
        symbiosis.Executor.from_pretrained(path)


def test_missing_shard(tmp_path):
    make_checkpoint("llama", tmp_path)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard.*missing.*model-00002-of-00002"):
        symbiosis.Executor.from_pretrained(tmp_path)


def test_pytorch_bin_only(tmp_path, llama):
    path, _ = llama
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        symbiosis.Executor.from_pretrained(path)


def test_fingerprint_mismatch(tmp_path, llama):
    path, auto_class = llama
    make_checkpoint("llama", tmp_path / "other", seed=7)
    executor = symbiosis.Executor.from_pretrained(path)
    with pytest.raises(FingerprintMismatch, match="different checkpoint"):
        symbiosis.from_pretrained(tmp_path / "other", executor, auto_class=auto_class)


def test_bad_calls_fail_alone_and_the_executor_keeps_serving(llama):
    path, auto_class = llama
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    healthy = symbiosis.from_pretrained(path, executor, auto_class=auto_class, name="healthy")
    ids = torch.randint(0, 128, (1, 6))
    expected = healthy(ids).logits

    session = executor.attach(executor.fingerprint, name="careless")
    layer = "model.layers.0.self_attn.q_proj"
    with pytest.raises(BadCall, match=r"expects \[tokens, 64\], got \[3, 65\]"):
        session.executor.forward(session.client_id, layer, torch.zeros(3, 65, dtype=torch.float64))
    with pytest.raises(BadCall, match="expects torch.float64, got torch.float32"):
        session.executor.forward(session.client_id, layer, torch.zeros(3, 64))
    with pytest.raises(BadCall, match=r"backward call .* expects \[tokens, 64\]"):
        session.executor.backward(session.client_id, layer, torch.zeros(3, 7, dtype=torch.float64))
    with pytest.raises(UnknownLayer, match="no base layer 'model.layers.9.q_proj'"):
        session.forward("model.layers.9.q_proj", torch.zeros(3, 64, dtype=torch.float64))
    with pytest.raises(UnknownClient, match="'ghost-1' is not attached"):
        executor.forward("ghost-1", layer, torch.zeros(3, 64, dtype=torch.float64))
    session.close()
    with pytest.raises(UnknownClient):
        session.forward(layer, torch.zeros(3, 64, dtype=torch.float64))

    assert torch.equal(healthy(ids).logits, expected)


def test_call_over_the_size_limit(llama):
    path, _ = llama
    executor = symbiosis.Executor.from_pretrained(path, max_call_tokens=8)
    session = executor.attach(executor.fingerprint)
    with pytest.raises(BadCall, match="9 tokens, more than this executor's limit of 8"):
        session.forward("model.layers.0.mlp.up_proj", torch.zeros(9, 64))
    assert session.forward("model.layers.0.mlp.up_proj", torch.zeros(8, 64)).shape == (8, 112)


def test_client_code_reading_a_base_weight_is_told_why(llama):
    path, auto_class = llama
    model = symbiosis.from_pretrained(path, symbiosis.Executor.from_pretrained(path), auto_class=auto_class)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.shape == (112, 64) and weight.dtype == torch.float32
    with pytest.raises(symbiosis.VirtualWeightAccess, match="'model.layers.0.mlp.up_proj' is held by the symbiosis"):
        weight.sum()
    with pytest.raises(symbiosis.VirtualWeightAccess):
        model.save_pretrained(path / "copy")


def test_any_read_of_a_virtual_weight_names_the_layer(llama):
    """Ops on one virtual weight, or on several in a list (torch.cat), raise VirtualWeightAccess naming the layer."""
    path, _ = llama
    model = symbiosis.from_pretrained(path, symbiosis.Executor.from_pretrained(path))
    q = model.model.layers[0].self_attn.q_proj.weight
    for read in (lambda: q + 1, lambda: torch.cat([q, model.model.layers[1].self_attn.q_proj.weight]),
                 lambda: torch.linalg.vector_norm(q, dim=1)):
        with pytest.raises(symbiosis.VirtualWeightAccess, match="model.layers.[01].self_attn.q_proj"):
            read()
