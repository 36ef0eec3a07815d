"""Bottleneck (Houlsby) adapters as files, and applied to a plain transformers model (the reference the engine is
tested against). PEFT has no bottleneck method, so symbiosis writes them in PEFT's layout:

    adapter_config.json        {"peft_type": "BOTTLENECK", "bottleneck_size": r, "non_linearity": "relu" | "gelu" |
                                "silu", "scaling": 1.0, "target_modules": ["self_attn.o_proj", "mlp.down_proj"]}
    adapter_model.safetensors  base_model.model.<module>.bottleneck.down.weight [r, out], .down.bias [r],
                               base_model.model.<module>.bottleneck.up.weight [out, r], .up.bias [out]

A targeted module's output y becomes y + scaling * up(act(down(y))) (Houlsby et al. 2019; HMI eq. 1): placed on
the attention's output projection and the MLP's, it is Houlsby's adapter after each sublayer, before the
residual add.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from symbiosis.kernels.bottleneck import ACTIVATIONS

PREFIX = "base_model.model."
PARTS = ("down.weight", "down.bias", "up.weight", "up.bias")


def save_bottleneck(directory, weights: dict[str, dict[str, torch.Tensor]], non_linearity: str = "relu",
                    scaling: float = 1.0) -> Path:
    """Write an adapter: `weights` maps each module name to its tensors (PARTS)."""
    if non_linearity not in ACTIVATIONS:
        raise ValueError(f"non_linearity must be one of {ACTIVATIONS}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = {tensors["down.weight"].shape[0] for tensors in weights.values()}
    tensors = {f"{PREFIX}{module}.bottleneck.{part}": t.contiguous() for module, parts in weights.items()
               for part, t in parts.items()}
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "BOTTLENECK", "bottleneck_size": max(ranks), "non_linearity": non_linearity, "scaling": scaling,
        "target_modules": sorted({module.split(".", 2)[-1] for module in weights})}, indent=1))
    return directory


def random_bottleneck(model: nn.Module, suffixes: tuple[str, ...], rank: int, seed: int, std: float = 0.3) -> dict:
    """Random weights for every linear module of `model` whose name ends with one of `suffixes` (tests,
    benchmarks)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if name.endswith(suffixes) and hasattr(module, "weight"):
            out = module.weight.shape[1] if type(module).__name__ == "Conv1D" else module.weight.shape[0]
            weights[name] = {"down.weight": torch.randn(rank, out, generator=generator) * std,
                             "down.bias": torch.randn(rank, generator=generator) * std,
                             "up.weight": torch.randn(out, rank, generator=generator) * std,
                             "up.bias": torch.randn(out, generator=generator) * std}
    return weights


def attach_bottleneck(model: nn.Module, directory) -> list:
    """Apply the adapter in `directory` to a plain transformers `model` with forward hooks (returns their handles)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    act = {"relu": torch.relu, "gelu": nn.functional.gelu, "silu": nn.functional.silu}[config["non_linearity"]]
    tensors = load_file(directory / "adapter_model.safetensors")
    handles = []
    for module_name in {name.removeprefix(PREFIX).rsplit(".bottleneck.", 1)[0] for name in tensors}:
        part = {p: tensors[f"{PREFIX}{module_name}.bottleneck.{p}"] for p in PARTS}

        def hook(_module, _args, y, part=part):
            w = {k: v.to(y.dtype) for k, v in part.items()}
            return y + config["scaling"] * (act(y @ w["down.weight"].T + w["down.bias"]) @ w["up.weight"].T
                                            + w["up.bias"])
        handles.append(model.get_submodule(module_name).register_forward_hook(hook))
    return handles
