"""Adapters trained through symbiosis are ordinary PEFT files, and the reverse."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model

import symbiosis
from test_exactness import assert_close, batch, peft_config

METHODS = ["lora", "ia3", "prompt", "prefix", "loha"]


def _train(model, arch, steps=2):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        model(**batch(arch, seed=step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.mark.parametrize("method", METHODS)
def test_symbiosis_adapter_loads_in_plain_peft_and_back(method, checkpoints, tmp_path):
    arch = "llama"
    path, auto_class = checkpoints(arch)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    probe = batch(arch, seed=9)

    # symbiosis -> plain PEFT
    split = _train(get_peft_model(symbiosis.from_pretrained(path, executor, auto_class=auto_class),
                                  peft_config(method, arch)), arch)
    split.save_pretrained(tmp_path / "ours")
    assert (tmp_path / "ours" / "adapter_config.json").is_file()
    assert (tmp_path / "ours" / "adapter_model.safetensors").is_file()
    plain = PeftModel.from_pretrained(auto_class.from_pretrained(path, dtype=torch.float64), tmp_path / "ours")
    with torch.no_grad():
        assert_close(plain(**probe).logits, split(**probe).logits, "plain PEFT on symbiosis' adapter")

    # plain PEFT -> symbiosis
    reference = _train(get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64),
                                      peft_config(method, arch)), arch)
    reference.save_pretrained(tmp_path / "theirs")
    loaded = PeftModel.from_pretrained(symbiosis.from_pretrained(path, executor, auto_class=auto_class),
                                       tmp_path / "theirs")
    with torch.no_grad():
        assert_close(loaded(**probe).logits, reference(**probe).logits, "symbiosis on plain PEFT's adapter")


def test_sequence_classification_head_trained_via_modules_to_save(checkpoints, tmp_path):
    """SEQ_CLS makes PEFT train a copy of the classifier, a base layer: the copy is a real client layer."""
    path, auto_class = checkpoints("bert")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    split = _train(get_peft_model(symbiosis.from_pretrained(path, executor, auto_class=auto_class),
                                  peft_config("lora", "bert")), "bert")
    trained_head = split.base_model.model.classifier.modules_to_save["default"]
    assert type(trained_head) is torch.nn.Linear and trained_head.weight.requires_grad
    split.save_pretrained(tmp_path / "cls")
    plain = PeftModel.from_pretrained(auto_class.from_pretrained(path, dtype=torch.float64), tmp_path / "cls")
    probe = batch("bert", seed=3)
    with torch.no_grad():
        assert_close(plain(**probe).logits, split(**probe).logits, "classifier logits")
