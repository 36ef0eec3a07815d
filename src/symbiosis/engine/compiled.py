"""Decoder layers compiled for decode steps: torch.compile fuses the small kernels between a layer's GEMMs
(norms, rotary embedding, residual adds, the MLP's activation and product, casts: ~40 launches of a few µs per
layer of a Llama decode step, docs/PERFORMANCE.md section 8) and keeps the engine's own operators whole
(`symbiosis::lora_apply`, `symbiosis::paged_attention`: launch plans and masks are host code).

Every decoder layer keeps its eager forward and gains a compiled one; `StepState.compiled` picks, per step. The
engine sets it for the steps it replays from CUDA graphs (one-token decodes at a few padded shapes), whose
compiled code is recorded with the graph; other steps (prefill chunks, of any shape) run eagerly. The layers
share one compiled code per step shape: a layer's weights, adapter pools and KV pool are inputs of it, and nothing
it reads names its layer (engine/layers.py), so a model of 32 layers compiles once per shape, not 32 times.
"""

from __future__ import annotations

import torch
from torch import nn

RECOMPILE_LIMIT = 64  # step shapes (row buckets) x adapters or none x the model's kinds of layer (sliding or not)


class _Either:
    """A decoder layer's forward: the compiled one while the engine's step asks for it, else the eager one."""

    def __init__(self, state, eager, compiled):
        self.state, self.eager, self.compiled = state, eager, compiled

    def __call__(self, *args, **kwargs):
        return (self.compiled if self.state.compiled else self.eager)(*args, **kwargs)


def compile_decoder_layers(model: nn.Module, attention_modules: list[nn.Module], state) -> int:
    """Give every decoder layer of `model` (the modules of a ModuleList that hold one of `attention_modules`) a
    compiled forward, used while `state.compiled`. Returns how many layers."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # On its first call a compiled function checks custom operators for aliasing under a dispatch mode, which the
    # flex_attention masks built inside symbiosis::paged_attention cannot run under; the operators declare their
    # mutations (and return fresh tensors), which is what that check is for.
    if hasattr(torch._functorch.config, "check_custom_op_aliasing"):  # torch 2.12 on
        torch._functorch.config.check_custom_op_aliasing = False
    holders = {id(module) for module in attention_modules}
    layers = [child for module in model.modules() if isinstance(module, nn.ModuleList) for child in module
              if any(id(inner) in holders for inner in child.modules())]
    for layer in layers:
        layer.forward = _Either(state, layer.forward, torch.compile(layer.forward, dynamic=False))
    return len(layers)
