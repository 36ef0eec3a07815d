"""HF Trainer drives a split model exactly as it drives the plain one."""

from __future__ import annotations

import torch
from peft import get_peft_model
from transformers import Trainer, TrainingArguments

import symbiosis
from helpers import assert_close
from matrix import peft_config


def _dataset(n=8, length=12):
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(2, 128, (n, length), generator=g)]


def _run_trainer(model, out_dir):
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                             use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=3,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_on_split_model_matches_plain(checkpoints, tmp_path):
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    torch.manual_seed(0)
    split = get_peft_model(symbiosis.from_pretrained(path, executor, auto_class=auto_class), peft_config("lora", "llama"))
    torch.manual_seed(0)
    plain = get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64), peft_config("lora", "llama"))
    ours, theirs = _run_trainer(split, tmp_path / "a"), _run_trainer(plain, tmp_path / "b")
    assert len(ours) == 3 and ours == theirs
    reference = dict(plain.named_parameters())
    for name, param in split.named_parameters():
        if param.requires_grad:
            assert_close(param.detach(), reference[name].detach(), name)
