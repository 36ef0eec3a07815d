"""Hosted fine-tuning: many tenants' LoRA adapters trained together, one batched pass over the shared base per
step (the Tinker API of `symbiosis serve` runs on it)."""

from symbiosis.train.lora import HostedLora, LoraSpec
from symbiosis.train.losses import LOSSES
from symbiosis.train.trainer import Trainer, Work

__all__ = ["HostedLora", "LOSSES", "LoraSpec", "Trainer", "Work"]
