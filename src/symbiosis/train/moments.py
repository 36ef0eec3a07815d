"""AdamW's state in files, without pickle: optimizer.safetensors (exp_avg / exp_avg_sq of each named tensor) and
optimizer_steps.json (each tensor's step count)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_moments(optimizer: torch.optim.Optimizer, parameters: dict[str, torch.Tensor], directory: Path) -> None:
    tensors, steps = {}, {}
    for name, parameter in parameters.items():
        state = optimizer.state.get(parameter, {})
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment in state:
                tensors[f"{name}.{moment}"] = state[moment].detach().contiguous().cpu()
        if "step" in state:
            steps[name] = float(state["step"])
    save_file(tensors, directory / "optimizer.safetensors")
    (directory / "optimizer_steps.json").write_text(json.dumps(steps))


def load_moments(optimizer: torch.optim.Optimizer, parameters: dict[str, torch.Tensor], directory: Path) -> None:
    moments = load_file(directory / "optimizer.safetensors")
    steps = json.loads((directory / "optimizer_steps.json").read_text())
    for name, parameter in parameters.items():
        if f"{name}.exp_avg" in moments:
            optimizer.state[parameter] = {
                "step": torch.tensor(steps[name]), "exp_avg": moments[f"{name}.exp_avg"].to(parameter),
                "exp_avg_sq": moments[f"{name}.exp_avg_sq"].to(parameter)}
