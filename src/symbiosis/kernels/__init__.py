"""GPU kernels beneath the engine: Punica-style SGMV LoRA (sgmv.py) with its torch reference (reference.py)."""

from symbiosis.kernels.sgmv import Segments, lora_apply, lora_expand, lora_shrink

__all__ = ["Segments", "lora_apply", "lora_expand", "lora_shrink"]
