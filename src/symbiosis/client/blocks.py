"""Gated MLPs run whole: one executor call where the tenant's adapter leaves an MLP's three projections frozen.

A Llama-style MLP is down(act(gate(x)) * up(x)). Called layer by layer it makes two calls each way, and carries
the [T, intermediate] activations both ways (at 1,024 tokens of Llama-3.2-1B: 56 MB a layer each way). Where the
executor offers the block (`Session.block_specs`) and the MLP's projections are still the virtual layers the client
was built with (no PEFT layer wraps them, no bias is trained), the MLP is one call: x in, y out. Its backward is
one call too, given x beside the output's gradient: the executor keeps no state, so it recomputes gate and up
(`store.GatedMlp`). The client keeps x for that, not the MLP's activations.

Only sessions whose calls carry tensors to another device or host call blocks (`RemoteSession.whole_blocks`:
tcp://, nccl://). There bytes and round trips cost more than the executor's recomputation (+27% of a Llama-3.2-1B
layer's GEMM work); in process and over ipc:// shared memory they do not, and a masked session cannot (the
activation is not linear in the noise).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from symbiosis.client.virtual import VirtualLinear, _synchronize_after_backward


class _BlockCall(torch.autograd.Function):
    """y = the executor's block(x); backward: grad_x = the executor's block backward([x | grad_y])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, session, block_id: str, inference: bool) -> torch.Tensor:
        ctx.session, ctx.block_id = session, block_id
        ctx.save_for_backward(x)
        return session.forward(block_id, x, inference=inference)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        _synchronize_after_backward(ctx.session)
        (x,) = ctx.saved_tensors
        return ctx.session.backward(ctx.block_id, torch.cat([x, grad_out.to(x.dtype)], dim=1)), None, None, None


def _frozen(layer: nn.Module) -> bool:
    """Still the client's virtual layer, nothing of it trained (PEFT wraps an adapted layer in its own class)."""
    return type(layer) is VirtualLinear and (layer.bias is None or not layer.bias.requires_grad)


# mlp module -> (block id, session): weakly, and only for the modules `serve_whole` was given. A copy of one (PEFT's
# `modules_to_save` deep-copies the modules it trains) is not in it: its projections are its own, so it calls them.
_WHOLE: "weakref.WeakKeyDictionary[nn.Module, tuple[str, object]]" = weakref.WeakKeyDictionary()


def serve_whole(mlp: nn.Module, block_id: str, session) -> None:
    """Route `mlp`'s forward to the executor's block `block_id` whenever its projections are frozen (checked at each
    call: PEFT may wrap them after the model is built, and unload its adapter later)."""
    _WHOLE[mlp] = (block_id, session)
    mlp.__class__ = _served_whole(type(mlp))


@functools.cache
def _served_whole(cls: type) -> type:
    """`cls` with the block's forward (same name: what prints or matches the class by name sees no difference)."""
    layers_forward = cls.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        served = _WHOLE.get(self)
        if served is not None and _frozen(self.gate_proj) and _frozen(self.up_proj) and _frozen(self.down_proj):
            return _whole(x, *served)
        return layers_forward(self, x)

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})


@torch.compiler.disable  # a call to the executor: a graph break in a compiled client, as every layer call is
def _whole(x: torch.Tensor, block_id: str, session) -> torch.Tensor:
    out = _BlockCall.apply(x.reshape(-1, x.shape[-1]), session, block_id, not torch.is_grad_enabled())
    return out.view(*x.shape[:-1], out.shape[-1])
