"""Tiny random-weight checkpoints built from the real config classes, saved as real HF model directories."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

VOCAB = 128

# name -> (config class, config kwargs, model class that saves the checkpoint, auto class a user loads with)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
              transformers.LlamaForCausalLM, transformers.AutoModelForCausalLM),
    "gpt2": (transformers.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=1),
             transformers.GPT2LMHeadModel, transformers.AutoModelForCausalLM),
    "gpt_bigcode": (transformers.GPTBigCodeConfig, dict(n_embd=64, n_layer=2, n_head=4, n_positions=128,
                    multi_query=True, bos_token_id=0, eos_token_id=1), transformers.GPTBigCodeForCausalLM, transformers.AutoModelForCausalLM),
    "gemma2": (transformers.Gemma2Config, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6),
               transformers.Gemma2ForCausalLM, transformers.AutoModelForCausalLM),
    "granite": (transformers.GraniteConfig, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=2.0, logits_scaling=4.0,
                residual_multiplier=0.5, attention_multiplier=0.25),
                transformers.GraniteForCausalLM, transformers.AutoModelForCausalLM),
    "qwen2": (transformers.Qwen2Config, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2), transformers.Qwen2ForCausalLM,
              transformers.AutoModelForCausalLM),
    # Saved by transformers 5 with its head as `embed_out`, which transformers renames to `lm_head` on load.
    "gpt_neox": (transformers.GPTNeoXConfig, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                 num_attention_heads=4, rotary_pct=0.5, tie_word_embeddings=False), transformers.GPTNeoXForCausalLM,
                 transformers.AutoModelForCausalLM),
    "opt": (transformers.OPTConfig, dict(hidden_size=64, ffn_dim=112, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=64), transformers.OPTForCausalLM, transformers.AutoModelForCausalLM),
    "bert": (transformers.BertConfig, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=112, num_labels=3), transformers.BertForSequenceClassification,
             transformers.AutoModelForSequenceClassification),
}


def make_checkpoint(arch: str, directory, dtype=torch.float32, seed: int = 0, **overrides):
    """Save a tiny random `arch` model (config + model.safetensors) into `directory`; returns its auto class."""
    config_cls, kwargs, model_cls, auto_class = ARCHITECTURES[arch]
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=128, **{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():  # transformers starts biases at zero: code that mishandles them would pass unnoticed
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.5)
    model.save_pretrained(directory)
    return auto_class


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch name -> (path, auto class), built once per test session."""
    built = {}

    def get(arch: str):
        if arch not in built:
            path = tmp_path_factory.mktemp(arch)
            built[arch] = (path, make_checkpoint(arch, path))
        return built[arch]

    return get


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
