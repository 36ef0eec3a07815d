"""PEFT layers whose forward computes with the base weight, rewritten so that only executor calls touch it.

Each class is PEFT's own layer with one method replaced; `peft_support` swaps it in (`module.__class__`)
right after PEFT has built the layer over a virtual base layer, so parameters, state dicts and saved files
are PEFT's. Disabled adapters and merging keep PEFT's code (merging reads W, and raises on a split model).

- HRA multiplies W from the right by an orthogonal product of Householder reflections H [in, in]:
  F.linear(x, W H, b) = (x Hᵀ) Wᵀ + b, the base layer applied to x Hᵀ.
- SHiRA adds a sparse update to a copy of W: F.linear(x, W + ΔW, b) = x Wᵀ + b + x ΔWᵀ (PEFT's own path for
  quantised base layers that cannot be dequantised).
- PEANuT feeds Wᵀ A_pᵀ through its adapter network. Wᵀ A_pᵀ = (A_p W)ᵀ is the executor's backward call with
  A_p [r, out] as the output gradient, and its gradient with respect to A_p, G Wᵀ, a bias-free forward call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.hra.layer import HRALinear
from peft.tuners.peanut.layer import Linear as PeanutLinear
from peft.tuners.shira.layer import Linear as ShiraLinear
from transformers.activations import ACT2FN


class SplitHRALinear(HRALinear):
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters or self.merged:
            return super().forward(x, *args, **kwargs)
        previous_dtype = x.dtype
        rotation = torch.eye(self.in_features, device=x.device)  # H, as PEFT composes it: [in, in]
        for active_adapter in self.active_adapters:
            if active_adapter in self.hra_u:
                delta = self.get_delta_weight(active_adapter)
                rotation = torch.mm(rotation.to(delta.dtype), delta)
        return self.base_layer(x.to(rotation.dtype) @ rotation.T, *args, **kwargs).to(previous_dtype)


class SplitShiraLinear(ShiraLinear):
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.disable_adapters or self.merged:
            return super().forward(x, *args, **kwargs)
        base_result = self.base_layer(x, *args, **kwargs)
        delta = torch.zeros(self.out_features, self.in_features).to(base_result)
        for active_adapter in self.active_adapters:
            if active_adapter in self.shira_weight:
                delta += self.get_delta_weight(active_adapter)
        return base_result + F.linear(x, delta)


class _LeftProduct(torch.autograd.Function):
    """A W for a tenant matrix A [r, out] (backward call); grad_A = G Wᵀ (bias-free forward call)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, session, layer_id: str) -> torch.Tensor:
        ctx.session, ctx.layer_id = session, layer_id
        return session.backward(layer_id, a)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.session.forward_nobias(ctx.layer_id, grad), None, None


class SplitPeanutLinear(PeanutLinear):
    def get_delta_weight(self, adapter) -> torch.Tensor:
        # PEFT's _compute_delta_weight, with W^T A^T computed as (A W)^T by the executor.
        peanut_a = self.peanut_A[adapter].weight
        base = self.get_base_layer()
        non_linear = ACT2FN[self.act_fn[adapter]]
        delta_w = non_linear(_LeftProduct.apply(peanut_a, base.session, base.layer_id).T)
        residuals = []
        for encoder in self.peanut_encoders[adapter][: self.res_num[adapter]]:
            residuals.append(delta_w)
            delta_w = non_linear(encoder(delta_w))
        for i, decoder in enumerate(self.peanut_decoders[adapter][: self.res_num[adapter]]):
            delta_w = non_linear(decoder(delta_w)) + residuals[-1 - i]
        return (self.peanut_B[adapter](delta_w) * self.scaling[adapter]).transpose(0, 1)


REWRITES = {HRALinear: SplitHRALinear, ShiraLinear: SplitShiraLinear, PeanutLinear: SplitPeanutLinear}
