"""Bad input gets a clear error naming the problem, and the executor keeps serving everyone else."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch

import symbiosis
from symbiosis.errors import BadCall, CheckpointError, FingerprintMismatch, UnknownClient, UnknownLayer
from matrix import make_checkpoint


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


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", 7])
def test_index_shard_names_stay_inside_the_model_directory(shard, tmp_path):
    """An index naming a file outside the directory is refused before anything is opened."""
    make_checkpoint("llama", tmp_path / "model")
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "model" / "model.safetensors").read_bytes())
    index = {"metadata": {}, "weight_map": {"lm_head.weight": shard}}
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a file name inside"):
        symbiosis.Executor.from_pretrained(tmp_path / "model")


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.up_proj.weight",
                                    "model.layers.1.post_attention_layernorm.weight"])  # (a decoder tail's norm)
def test_nan_or_inf_in_a_base_weight_is_refused_at_load(tensor, llama):
    from safetensors.torch import load_file, save_file

    path, _ = llama
    tensors = load_file(path / "model.safetensors")
    tensors[tensor].view(-1)[5] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"'{tensor}' holds NaN or Inf"):
        symbiosis.Executor.from_pretrained(path)


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


OUT_OF_MEMORY = """
import resource, sys, torch
import symbiosis
executor = symbiosis.Executor.from_pretrained(sys.argv[1], max_call_tokens=1 << 24)
session = executor.attach(executor.fingerprint)
x = torch.randn(1 << 21, 64)  # 2M tokens (512 MiB): lm_head's output would take 1 GiB
in_use = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (in_use + (300 << 20), resource.RLIM_INFINITY))
try:
    session.forward("lm_head", x)
except symbiosis.ExecutorOutOfMemory as e:
    print("out of memory:", e)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print("then served:", list(session.forward("lm_head", x[:4]).shape))
"""


def test_a_call_too_big_for_the_executors_memory_fails_as_out_of_memory(llama):
    """On a CPU executor too (whose allocator raises a plain RuntimeError), in a process with 300 MiB to spare."""
    path, _ = llama
    done = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert "out of memory: the executor's cpu has no memory for 2097152 tokens of forward on 'lm_head'" in done.stdout, \
        done.stdout + done.stderr
    assert "then served: [4, 128]" in done.stdout


def _held_bytes(executor) -> int:
    """Bytes of every distinct storage the executor's weights and groups hold."""
    tensors = [t for layer in executor.weights.layers.values() for t in (layer.weight, layer.bias) if t is not None]
    tensors += [t for group in executor.weights.groups.values() for t in (getattr(group, "weight", None),
                                                                           getattr(group, "bias", None)) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_group_ids_cannot_grow_the_executor(llama):
    """A tenant naming every combination of layers as a group: only siblings of one module form a group; the
    first fuses (memory as before), later ones view it or run member by member; the results stay exact."""
    import itertools

    path, _ = llama
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    session = executor.attach(executor.fingerprint, "attacker")
    before = _held_bytes(executor)
    block = "model.layers.0.self_attn."
    names = [block + n for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    x = torch.randn(3, 64, dtype=torch.float64)
    for size in (2, 3, 4):
        for members in itertools.permutations(names, size):
            if members[-1] == block + "o_proj" and size == 2:
                continue
            group = "+".join(members)
            expected = torch.cat([session.forward(m, x) for m in members], dim=1)
            assert torch.allclose(session.forward(group, x), expected, rtol=1e-12, atol=1e-12), group
            grad = torch.randn(3, expected.shape[1], dtype=torch.float64)
            widths = [executor.layer_specs[m].out_features for m in members]
            parts = zip(members, grad.split(widths, dim=1))
            assert torch.allclose(session.backward(group, grad), sum(session.backward(m, g) for m, g in parts),
                                  rtol=1e-12, atol=1e-12)
    assert _held_bytes(executor) == before
    assert len(executor.weights.groups) <= 4 * 3 * 2 + 4 * 3 * 2 * 1 + 4 * 3  # permutations of one block's layers
    with pytest.raises(UnknownLayer, match="serves no base layer"):  # layers of two modules are not a group
        session.forward(block + "q_proj+model.layers.1.self_attn.k_proj", x)
    with pytest.raises(UnknownLayer):
        session.forward("model.layers.0.mlp.gate_proj+model.layers.0.mlp.down_proj", x)  # other input width
