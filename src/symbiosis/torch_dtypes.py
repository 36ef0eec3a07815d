"""The `dtype` / `torch_dtype` argument convention of transformers 5, shared by client and executor."""

from __future__ import annotations

import warnings

import torch
from transformers import PretrainedConfig


def resolve_dtype(dtype, torch_dtype, config: PretrainedConfig) -> torch.dtype:
    """`dtype` wins; `torch_dtype` is its deprecated alias; default: the config's dtype, else float32."""
    if torch_dtype is not None:
        warnings.warn("`torch_dtype` is deprecated; use `dtype`", FutureWarning, stacklevel=3)
        dtype = dtype if dtype is not None else torch_dtype
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype, got {dtype!r}")
    return dtype
