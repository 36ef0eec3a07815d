"""The base weights: every base layer's W (+ b), loaded once, read-only, on the executor's device.

Math per layer (T tokens):
    linear:  forward y = x W^T + b   backward grad_x = g W      (W: [out, in])
    conv1d:  forward y = x W + b     backward grad_x = g W^T    (W: [in, out])
No gradient is computed for W or b: base layers are frozen.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from symbiosis.errors import CheckpointError
from symbiosis.model.layout import Layout
from symbiosis.model.partition import GROUP_SEPARATOR, BaseLayerSpec


@dataclass
class BaseLayer:
    spec: BaseLayerSpec
    weight: torch.Tensor
    bias: torch.Tensor | None

    @functools.cached_property
    def squared_norms(self) -> torch.Tensor:
        """||W_o||^2 per output feature o [out], summed in at least float32."""
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        return self.weight.to(dtype).square().sum(dim=1 if self.spec.kind == "linear" else 0)

    @property
    def expected_shape(self) -> tuple[int, int]:
        spec = self.spec
        return (spec.out_features, spec.in_features) if spec.kind == "linear" else (spec.in_features, spec.out_features)

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

    A tensor shared by several layers (tied weights) is read and held once. A *group* id, layer ids joined
    by "+" ("...q_proj+...k_proj+...v_proj"), names the layers that take one input, run as one GEMM:
    y = x [W_q; W_k; W_v]^T. Its fused weight is made on first use, and the members' weights become views
    of it, so memory stays as it was.
    """

    def __init__(self, layout: Layout, specs: list[BaseLayerSpec], device: torch.device, dtype: torch.dtype):
        names = {s.weight_name for s in specs} | {s.bias_name for s in specs if s.bias_name}
        loaded = layout.read(dict.fromkeys(sorted(names), dtype), device)  # a tied tensor once
        self.layers = {s.layer_id: BaseLayer(s, loaded[s.weight_name], loaded[s.bias_name] if s.bias_name else None)
                       for s in specs}
        for layer in self.layers.values():  # a converter's output is known only now; a bias is not checked before
            for name, tensor, expected in ((layer.spec.weight_name, layer.weight, layer.expected_shape),
                                           (layer.spec.bias_name, layer.bias, (layer.spec.out_features,))):
                if tensor is not None and tensor.shape != expected:
                    raise CheckpointError(f"{layout.checkpoint.listing}: {layout.keys(name)} make {name!r} of shape "
                                          f"{list(tensor.shape)}, the config implies {list(expected)}")
        self.nbytes = sum(t.numel() * t.element_size() for t in loaded.values())
        self.groups: dict[str, BaseLayer | None] = {}
        self._lock = threading.Lock()

    def tensor(self, name: str) -> torch.Tensor | None:
        """The weight read as tensor `name`, if a layer holds one (a tied lm_head: the embedding)."""
        return next((layer.weight for layer in self.layers.values() if layer.spec.weight_name == name), None)

    def get(self, layer_id: str) -> BaseLayer | None:
        """A layer or group by id; None if there is no such layer, or the group cannot be fused."""
        layer = self.layers.get(layer_id)
        if layer is not None or GROUP_SEPARATOR not in layer_id:
            return layer
        with self._lock:
            if layer_id not in self.groups:
                self.groups[layer_id] = self._fuse(layer_id.split(GROUP_SEPARATOR))
            return self.groups[layer_id]

    def _fuse(self, ids: list[str]) -> BaseLayer | None:
        members = [self.layers.get(i) for i in ids]
        if len(set(ids)) < 2 or len(set(ids)) != len(ids) or any(m is None for m in members):
            return None
        first = members[0]
        if any(m.spec.kind != first.spec.kind or m.spec.in_features != first.spec.in_features
               or (m.bias is None) != (first.bias is None) for m in members):
            return None
        out_dim = 0 if first.spec.kind == "linear" else 1  # linear W: [out, in]; conv1d W: [in, out]
        weight = torch.cat([m.weight for m in members], dim=out_dim)
        bias = None if first.bias is None else torch.cat([m.bias for m in members])
        offset = 0
        for m in members:  # members now view the fused tensors
            width = m.spec.out_features
            m.weight = weight.narrow(out_dim, offset, width)
            m.bias = None if bias is None else bias.narrow(0, offset, width)
            offset += width
        spec = BaseLayerSpec(GROUP_SEPARATOR.join(ids), first.spec.kind, first.spec.in_features, offset, "",
                             None if bias is None else "")
        if weight.is_cuda:
            # The members' old tensors are free now, but PyTorch's allocator would keep their memory reserved
            # for this process: a copy of every fused weight (16 GiB for Llama-2-13B's q/k/v and gate/up),
            # lost to other processes. Hand it back (once per group; cudaFree waits for the device).
            torch.cuda.empty_cache()
        return BaseLayer(spec, weight, bias)
