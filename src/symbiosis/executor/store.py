"""The base weights: every base layer's W (+ b), loaded once, read-only, on the executor's device.

Math per layer (T tokens):
    linear:  forward y = x W^T + b   backward grad_x = g W      (W: [out, in])
    conv1d:  forward y = x W + b     backward grad_x = g W^T    (W: [in, out])
No gradient is computed for W or b: base layers are frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from symbiosis.model.checkpoint import Checkpoint
from symbiosis.model.partition import BaseLayerSpec


@dataclass
class BaseLayer:
    spec: BaseLayerSpec
    weight: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        bias = self.bias if with_bias else None
        if self.spec.kind == "linear":
            return F.linear(x, self.weight, bias)
        return x @ self.weight if bias is None else torch.addmm(bias, x, self.weight)

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        # grad_out: [T, out] -> grad_in: [T, in]
        return grad_out @ self.weight if self.spec.kind == "linear" else grad_out @ self.weight.t()


class BaseWeights:
    """layer id -> BaseLayer, read from the checkpoint (base tensors only) onto `device` in `dtype`.

    A tensor shared by several layers (tied weights) is read and held once.
    """

    def __init__(self, checkpoint: Checkpoint, specs: list[BaseLayerSpec], device: torch.device, dtype: torch.dtype):
        loaded: dict[str, torch.Tensor] = {}

        def tensor(key: str) -> torch.Tensor:
            if key not in loaded:
                loaded[key] = checkpoint.read(key, dtype=dtype, device=device)
            return loaded[key]

        self.layers = {
            s.layer_id: BaseLayer(s, tensor(s.weight_key), tensor(s.bias_key) if s.bias_key else None) for s in specs
        }
        self.nbytes = sum(t.numel() * t.element_size() for t in loaded.values())
