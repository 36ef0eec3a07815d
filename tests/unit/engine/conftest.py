"""The engine's tests' checkpoints and LoRA adapters."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from matrix import ATTENTION, FEEDFORWARD, make_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (checkpoint, {adapter name: directory}): three LoRA adapters of different ranks, scalings and
    targets (one on every linear layer, the input embedding and the head)."""
    made = {}

    def get(arch):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"engine-{arch}")
            make_checkpoint(arch, root / "base")
            base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float64)
            embedding = next(n for n, m in base.named_modules() if m is base.get_input_embeddings()).split(".")[-1]
            configs = {
                "attn_r2": peft.LoraConfig(r=2, lora_alpha=4, target_modules=ATTENTION[arch], init_lora_weights=False),
                "mlp_r8": peft.LoraConfig(r=8, lora_alpha=32, target_modules=ATTENTION[arch] + [FEEDFORWARD[arch]],
                                          init_lora_weights=False),
                "everything_rs": peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False,
                                                 target_modules="all-linear"),
            }
            if arch == "llama":  # the input embedding and the head too
                configs["embed_head"] = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                        target_modules=["q_proj", embedding, "lm_head"])
            adapters = {}
            for i, (name, config) in enumerate(configs.items()):
                torch.manual_seed(10 + i)
                model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float64), config)
                with torch.no_grad():  # large enough that a wrong or missing adapter changes the tokens
                    for n, p in model.named_parameters():
                        if "lora_" in n:
                            p.normal_(0, 0.3)
                model.save_pretrained(root / name)
                adapters[name] = root / name
            made[arch] = (root / "base", adapters)
        return made[arch]

    return get
