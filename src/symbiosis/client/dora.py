"""DoRA on a split model, exact, with the base weight left in the executor.

PEFT's DoRA (`peft.tuners.lora.dora.DoraLinearLayer`) rescales each output feature o of W + s·B·A to a
learned magnitude m_o. With ||·||_o the norm of output feature o's weights, treated as a constant in
backward (DoRA §4.3; PEFT detaches it), PEFT computes on top of the base output x Wᵀ + b:

    (m / ||W + s B A||_o - 1) ⊙ x Wᵀ  +  m / ||W + s B A||_o ⊙ s x Aᵀ Bᵀ

The norm needs W only through two products with it:

    ||W_o + s (B A)_o||² = ||W_o||²  +  2 s Σ_r B[o, r] (A Wᵀ)[r, o]  +  s² ||(B A)_o||²

so the client asks the executor for ||W_o||² once per layer (`weight_norms`, a public fact about the base)
and for A Wᵀ at each forward (one `forward_nobias` call of r rows: A travels like r tokens of activations,
masked like them under `NoiseMasking`); the rest is the client's. x Wᵀ is the base output less its bias
(the client holds a copy of the bias); with dropout, PEFT's x is the dropped-out input, whose x Wᵀ is one
more bias-free call with autograd. For a transformers `Conv1D` (W: [in, out], `fan_in_fan_out`) the
executor's calls already compute in that layout, so nothing changes.

Merging (`merge_and_unload`) still reads W and raises `VirtualWeightAccess`, as for plain LoRA.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.dora import DoraLinearLayer
from peft.tuners.lora.variants import DoraLinearVariant
from torch import nn

from symbiosis.client.virtual import base_forward


class SplitDoraLinearLayer(DoraLinearLayer):
    """PEFT's `DoraLinearLayer` (same parameter, `weight` = the magnitude m) over a virtual base layer."""

    def __init__(self, fan_in_fan_out: bool):
        super().__init__(fan_in_fan_out)
        self._norms: dict[tuple, torch.Tensor] = {}  # ||W_o||^2 by (device, dtype): the base's, not state

    def _base_norms(self, base_layer: nn.Module, device, dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._norms:
            self._norms[key] = base_layer.session.weight_norms(base_layer.layer_id).to(device, dtype)
        return self._norms[key]

    def split_weight_norm(self, base_layer: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor,
                          scaling: float, dtype: torch.dtype) -> torch.Tensor:
        """||W_o + s (B A)_o|| for every output o, summed in at least float32, returned in `dtype`; nothing in it
        is differentiated (PEFT detaches the norm)."""
        wide = torch.promote_types(dtype, torch.float32)
        with torch.no_grad():
            a_w = base_forward(base_layer, lora_a.to(dtype), with_bias=False)  # A W^T [r, out] (direct path if any)
            a, b = lora_a.to(wide), lora_b.to(wide)  # [r, in], [out, r]
            # ||W_o||^2 + sum_r B[o, r] (2 s A W^T + s^2 (A A^T) B^T)[r, o]: the cross term and ||(B A)_o||^2
            # together, without forming B A [out, in]
            m = torch.addmm(a_w.to(wide), a @ a.T, b.T, beta=2 * scaling, alpha=scaling**2)  # [r, out]
            squared = self._base_norms(base_layer, a.device, wide) + torch.linalg.vecdot(b, m.T)
            return squared.clamp_min(0).sqrt().to(dtype)

    def update_layer(self, *, base_layer, lora_A, lora_B, scaling, place_on_cpu=False) -> None:
        # PEFT's magnitude starts as the norm of W + s B A, in the dtype W + s B A would have.
        dtype = torch.promote_types(lora_A.dtype, base_layer.weight.dtype)
        self.weight = nn.Parameter(self.split_weight_norm(base_layer, lora_A, lora_B, scaling, dtype),
                                   requires_grad=True)

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name="default"):
        weight_norm = self.split_weight_norm(base_layer, lora_A.weight, lora_B.weight, scaling, x.dtype)
        mag_norm_scale = (self.weight / weight_norm).view(1, -1)
        lora_result = lora_B(lora_A(x))
        if base_result is not None:
            if base_layer.bias is not None:  # the client's copy of the base bias (virtual.py)
                base_result = base_result - base_layer.bias
        else:  # x is dropped out: its own x W^T, differentiated
            base_result = base_forward(base_layer, x, with_bias=False)
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling

    def __repr__(self) -> str:
        return "symbiosis.split." + super().__repr__()


class SplitDoraLinearVariant(DoraLinearVariant):
    """PEFT's DoRA variant of a LoRA `Linear` whose base layer is virtual. Forward is PEFT's own (it calls the
    magnitude module); merging is inherited and refused by the virtual weight."""

    @staticmethod
    def init(module, adapter_name: str, **kwargs) -> None:
        if not module.lora_magnitude_vector:  # as PEFT: the magnitude is a trained adapter parameter
            module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)
        dora_layer = SplitDoraLinearLayer(fan_in_fan_out=getattr(module, "fan_in_fan_out", False))
        dora_layer.update_layer(base_layer=module.get_base_layer(), lora_A=module.lora_A[adapter_name].weight,
                                lora_B=module.lora_B[adapter_name].weight, scaling=module.scaling[adapter_name])
        module.lora_magnitude_vector[adapter_name] = dora_layer
