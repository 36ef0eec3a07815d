"""Each side reads and holds only what it owns; tied weights; sharded checkpoints; fingerprints."""

from __future__ import annotations

import peft
import pytest
import torch

import symbiosis
from symbiosis.client.virtual import VirtualWeight
from symbiosis.model.checkpoint import Checkpoint
from matrix import ARCHITECTURES, make_checkpoint


def _bytes(entries, keys, dtype=None):
    return sum(entries[k].nbytes // entries[k].dtype.itemsize * (dtype or entries[k].dtype).itemsize for k in keys)


def _probe_bytes(path) -> int:
    checkpoint = Checkpoint(path)
    return sum(len(checkpoint.content_probe(name)) for name in checkpoint.entries)


def test_each_side_reads_and_holds_only_its_own_tensors(tmp_path):
    for arch, tied in (("llama", False), ("gpt2", True)):
        path = tmp_path / arch
        auto_class = make_checkpoint(arch, path)
        entries = Checkpoint(path).entries
        executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
        specs = executor.layer_specs.values()
        bias_keys = {s.bias_name for s in specs if s.bias_name}
        base_keys = {s.weight_name for s in specs} | bias_keys
        # and the post-attention norms of the decoder tails it serves (client/blocks.py): the base's own, which the
        # executor applies for a tenant whose norm is the base's untouched
        norm_keys = {spec.weight_name.rpartition("+")[2] + ".weight" for spec in executor.block_specs.values()
                     if spec.kind == "decoder_tail"}
        assert bool(norm_keys) == (arch == "llama")
        # Weights only the executor reads; a tied lm_head's weight is the embedding, which the client needs too.
        own_weights = {s.weight_name for s in specs if s.weight_name == s.layer_id + ".weight"}
        assert (len({s.weight_name for s in specs} - own_weights) == 1) is tied
        assert bias_keys or arch == "llama"
        probes = _probe_bytes(path)
        assert probes <= 192 * len(entries)
        assert executor.checkpoint.bytes_read == _bytes(entries, base_keys | norm_keys) + probes
        assert executor.weights.nbytes == _bytes(entries, base_keys | norm_keys, torch.float64)

        model = symbiosis.from_pretrained(path, executor, auto_class=auto_class, dtype=torch.float64)
        # An in-process client takes a tied embedding from the executor instead of reading a copy; it holds a
        # frozen copy of the base biases (small, public, what BOFT and DoRA subtract from a base output).
        client_keys = set(entries) - base_keys | bias_keys
        assert model.symbiosis_checkpoint.bytes_read == _bytes(entries, client_keys) + probes
        executor_ptrs = {layer.weight.data_ptr() for layer in executor.weights.layers.values()}
        real = {p.data_ptr(): p for p in model.parameters() if not isinstance(p, VirtualWeight)}
        held = sum(p.numel() * p.element_size() for ptr, p in real.items() if ptr not in executor_ptrs)
        assert held == _bytes(entries, client_keys, torch.float64)
        assert len(set(real) & executor_ptrs) == (1 if tied else 0)
        virtual = [p for p in model.parameters() if isinstance(p, VirtualWeight)]
        assert len(virtual) == len(own_weights)


def test_tied_lm_head_is_served_by_the_executor_from_the_embedding(tmp_path):
    auto_class = make_checkpoint("gpt2", tmp_path)
    executor = symbiosis.Executor.from_pretrained(tmp_path, dtype=torch.float64)
    lm_head = executor.layer_specs["lm_head"]
    assert lm_head.weight_name == "transformer.wte.weight"
    model = symbiosis.from_pretrained(tmp_path, executor, auto_class=auto_class, dtype=torch.float64)
    assert model.lm_head.layer_id == "lm_head"
    weight, _ = executor.fetch(model.symbiosis_session.client_id, "lm_head")
    assert torch.equal(weight, model.transformer.wte.weight)


def test_sharded_checkpoint_with_index(tmp_path):
    config_cls, kwargs, model_cls, auto_class = ARCHITECTURES["llama"]
    full = model_cls(config_cls(vocab_size=128, **kwargs)).to(torch.float64)
    full.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    executor = symbiosis.Executor.from_pretrained(tmp_path)
    model = symbiosis.from_pretrained(tmp_path, executor, auto_class=auto_class)
    ids = torch.randint(0, 128, (2, 5))
    assert torch.equal(model(ids).logits, full(ids).logits)


def test_fingerprint_depends_on_weights_not_only_shapes(tmp_path):
    make_checkpoint("llama", tmp_path / "a", seed=0)
    make_checkpoint("llama", tmp_path / "b", seed=1)
    make_checkpoint("llama", tmp_path / "c", seed=0)
    a, b, c = (Checkpoint(tmp_path / n).fingerprint() for n in "abc")
    assert a != b and a == c


def test_base_model_checkpoint_loads_under_a_head_class(tmp_path):
    """A checkpoint saved from LlamaModel (no prefix, no head) used with AutoModelForCausalLM: the head is
    missing from the checkpoint, so the client owns it (initialised as transformers would)."""
    config_cls, kwargs, _, _ = ARCHITECTURES["llama"]
    import transformers

    body = transformers.LlamaModel(config_cls(vocab_size=128, **kwargs))
    body.save_pretrained(tmp_path)
    executor = symbiosis.Executor.from_pretrained(tmp_path, dtype=torch.float64)
    assert "layers.0.self_attn.q_proj" in executor.layer_specs and "lm_head" not in executor.layer_specs
    model = symbiosis.from_pretrained(tmp_path, executor, dtype=torch.float64)
    assert model.model.layers[0].self_attn.q_proj.layer_id == "layers.0.self_attn.q_proj"
    assert type(model.lm_head) is torch.nn.Linear
    ids = torch.randint(0, 128, (1, 4))
    hidden = body.to(torch.float64)(ids).last_hidden_state
    assert torch.allclose(model.model(ids).last_hidden_state, hidden, rtol=1e-12, atol=1e-12)


def test_in_process_clients_share_a_tied_embedding_and_cannot_train_it_in_place(tmp_path):
    """Held once for every in-process client, frozen; a gradient reaching it raises, and PEFT's
    modules_to_save trains a copy. A client in another dtype holds its own copy."""
    auto_class = make_checkpoint("gpt2", tmp_path)
    executor = symbiosis.Executor.from_pretrained(tmp_path, dtype=torch.float64)
    shared = executor.weights.tensor("transformer.wte.weight")
    first, second = (symbiosis.from_pretrained(tmp_path, executor, auto_class=auto_class) for _ in range(2))
    for model in (first, second):
        assert model.transformer.wte.weight.data_ptr() == shared.data_ptr()
        assert not model.transformer.wte.weight.requires_grad
    ids = torch.randint(0, 128, (2, 5))
    first.transformer.wte.weight.requires_grad_(True)
    with pytest.raises(symbiosis.VirtualWeightAccess, match="shared by every in-process client"):
        first(ids, labels=ids).loss.backward()
    before = shared.clone()
    tuned = peft.get_peft_model(second, peft.LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["wte"]))
    optimizer = torch.optim.SGD([p for p in tuned.parameters() if p.requires_grad], lr=1.0)
    tuned(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert torch.equal(shared, before)  # the copy trained, the base did not move
    assert not torch.equal(tuned.base_model.model.transformer.wte.modules_to_save["default"].weight, before)
    own = symbiosis.from_pretrained(tmp_path, executor, auto_class=auto_class, dtype=torch.float32)
    assert own.transformer.wte.weight.data_ptr() != shared.data_ptr()
