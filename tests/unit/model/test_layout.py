"""Both sides read a checkpoint through transformers' own key renaming and conversion (GPT-NeoX's renamed
head, a fused tensor that transformers chunks, legacy names), and a tensor the model needs that the
checkpoint lacks is refused before anything runs instead of silently initialised."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Chunk, WeightConverter

import symbiosis
from symbiosis.model.checkpoint import Checkpoint
from helpers import assert_close
from matrix import ARCHITECTURES, VOCAB


def rewrite_checkpoint(path, edit) -> None:
    """Replace model.safetensors in `path` by `edit(tensors)`."""
    tensors = edit(load_file(path / "model.safetensors"))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def copy_checkpoint(source, destination):
    shutil.copytree(source, destination)
    return destination


class FusedQKVLlamaForCausalLM(transformers.LlamaForCausalLM):
    """A Llama whose checkpoints hold q, k and v as one tensor, as some hub checkpoints do: transformers chunks
    it when it loads (a registered conversion) and fuses it again when it saves."""


register_checkpoint_conversion_mapping("FusedQKVLlamaForCausalLM", [WeightConverter(
    source_patterns="self_attn.qkv_proj.weight",
    target_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    operations=[Chunk(dim=0)])], overwrite=True)


def _ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def test_gpt_neox_head_is_read_where_transformers_reads_it(checkpoints):
    """transformers 5 saves GPT-NeoX's head as `embed_out` and renames it to `lm_head` on load: the executor
    serves it as `lm_head`, so the logits are the checkpoint's, not a random head's."""
    path, auto_class = checkpoints("gpt_neox")
    entries = Checkpoint(path).entries
    assert "embed_out.weight" in entries and "lm_head.weight" not in entries
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    assert executor.layer_specs["lm_head"].weight_name == "lm_head.weight"
    weight, _ = executor.fetch(executor.attach(executor.fingerprint).client_id, "lm_head")
    assert torch.equal(weight, Checkpoint(path).read("embed_out.weight", dtype=torch.float64))
    model = symbiosis.from_pretrained(path, executor, auto_class=auto_class, dtype=torch.float64)
    reference = auto_class.from_pretrained(path, dtype=torch.float64)
    with torch.no_grad():
        assert_close(model(_ids()).logits, reference(_ids()).logits, "GPT-NeoX logits")


def test_a_fused_tensor_is_split_by_transformers_conversion(tmp_path):
    """The checkpoint holds `qkv_proj`; transformers' registered converter chunks it into q, k, v. The executor
    reads the fused tensor (and only it, once) and serves the three layers that plain transformers loads."""
    config_cls, kwargs, _, _ = ARCHITECTURES["llama"]
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=128, **{**kwargs, "num_key_value_heads": 4})
    FusedQKVLlamaForCausalLM(config).to(torch.float64).save_pretrained(tmp_path)
    entries = Checkpoint(tmp_path).entries
    assert "model.layers.0.self_attn.qkv_proj.weight" in entries
    assert "model.layers.0.self_attn.q_proj.weight" not in entries
    executor = symbiosis.Executor.from_pretrained(tmp_path, auto_class=FusedQKVLlamaForCausalLM)
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"} <= set(executor.layer_specs)
    base_keys = [k for k in entries if "proj" in k or k == "lm_head.weight" or "post_attention_layernorm" in k]  # (tails')
    probes = sum(len(Checkpoint(tmp_path).content_probe(k)) for k in entries)  # the fingerprint's
    assert executor.checkpoint.bytes_read == sum(entries[k].nbytes for k in base_keys) + probes
    model = symbiosis.from_pretrained(tmp_path, executor, auto_class=FusedQKVLlamaForCausalLM)
    reference = FusedQKVLlamaForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reference.model.layers[1].self_attn.k_proj.weight,
                       executor.weights.layers["model.layers.1.self_attn.k_proj"].weight)
    with torch.no_grad():
        assert_close(model(_ids()).logits, reference(_ids()).logits, "logits")


def test_legacy_names_of_client_tensors_are_renamed(checkpoints, tmp_path):
    """A BERT checkpoint with TF-era `LayerNorm.gamma` / `beta` names (and values other than a fresh norm's
    ones and zeros): the client's norms load as plain transformers loads them."""
    source, auto_class = checkpoints("bert")
    path = copy_checkpoint(source, tmp_path / "legacy")
    generator = torch.Generator().manual_seed(5)
    rewrite_checkpoint(path, lambda tensors: {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"):
        v + torch.rand(v.shape, generator=generator) if "LayerNorm" in k else v for k, v in tensors.items()})
    assert "bert.embeddings.LayerNorm.gamma" in Checkpoint(path).entries
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    model = symbiosis.from_pretrained(path, executor, auto_class=auto_class, dtype=torch.float64)
    reference = auto_class.from_pretrained(path, dtype=torch.float64)
    assert not torch.equal(reference.bert.embeddings.LayerNorm.weight, torch.ones(64, dtype=torch.float64))
    with torch.no_grad():
        assert_close(model(_ids()).logits, reference(_ids()).logits, "logits with legacy norm names")


@pytest.mark.parametrize("arch,dropped", [
    ("llama", "model.layers.1.self_attn.q_proj.weight"),  # a base layer's weight
    ("llama", "model.norm.weight"),  # a client tensor: the executor checks the whole checkpoint up front
    ("gpt_neox", "embed_out.weight"),  # the renamed head: it is what lm_head needs
    ("gpt2", "transformer.wte.weight"),  # a tied embedding: lm_head has nothing to be tied to either
])
def test_a_missing_tensor_is_refused_before_any_compute(arch, dropped, checkpoints, tmp_path):
    source, _ = checkpoints(arch)
    path = copy_checkpoint(source, tmp_path / "incomplete")
    rewrite_checkpoint(path, lambda tensors: {k: v for k, v in tensors.items() if k != dropped})
    needed = dropped.replace("embed_out", "lm_head")
    with pytest.raises(symbiosis.CheckpointError, match=rf"model\.safetensors: no tensor for .*'{needed}'"):
        symbiosis.Executor.from_pretrained(path, dtype=torch.float64)


def test_a_client_refuses_a_missing_tensor_its_executor_does_not_need(checkpoints, tmp_path):
    """An executor that serves the body only (auto_class=LlamaModel) has no use for lm_head; a causal-LM client
    of a LlamaForCausalLM checkpoint without it is refused, not given a random head."""
    source, auto_class = checkpoints("llama")
    path = copy_checkpoint(source, tmp_path / "headless")
    rewrite_checkpoint(path, lambda tensors: {k: v for k, v in tensors.items() if k != "lm_head.weight"})
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, auto_class=transformers.LlamaModel)
    with pytest.raises(symbiosis.CheckpointError, match="no tensor for 'lm_head.weight'"):
        symbiosis.from_pretrained(path, executor, auto_class=auto_class)


def test_the_head_of_another_class_is_new_and_named(checkpoints, caplog):
    """A causal LM read as a sequence classifier: its `score` head is new (transformers initialises and reports
    it too); everything else comes from the checkpoint."""
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="symbiosis"):
        model = symbiosis.from_pretrained(path, executor, auto_class=transformers.AutoModelForSequenceClassification)
    assert "score.weight" in caplog.text and "new head" in caplog.text
    assert type(model.score) is torch.nn.Linear
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    with torch.no_grad():
        assert_close(model.model(_ids()).last_hidden_state, reference.model(_ids()).last_hidden_state, "hidden")
