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

Decoder tails go one step further (`serve_tail`): in a Llama-style decoder layer, o_proj, the residual, the
post-attention norm, the MLP and its residual are one call, [h | a] -> d, where a is o_proj's input and h the residual
stream plus the tenant's own o_proj delta; the layer adds h + d as it always does. The layer's own forward runs
unchanged; for its duration o_proj's base layer returns zeros (so a LoRA on o_proj returns its delta alone), the
norm returns its input h, and the MLP returns the tail's d. So two calls a layer each way instead of three.
"""

from __future__ import annotations

import functools
import weakref

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from symbiosis.client.virtual import VirtualLinear, _synchronize_after_backward
from symbiosis.errors import SymbiosisError


class _BlockCall(torch.autograd.Function):
    """y = the executor's block([x1 | x2 ...]) of inputs side by side [T, *]; backward: the executor's block
    backward([x1 | x2 ... | grad_y]) split back into each input's gradient."""

    @staticmethod
    def forward(ctx, session, block_id: str, inference: bool, *inputs: torch.Tensor) -> torch.Tensor:
        x = inputs[0] if len(inputs) == 1 else torch.cat(inputs, dim=1)
        ctx.session, ctx.block_id, ctx.widths = session, block_id, [t.shape[1] for t in inputs]
        ctx.save_for_backward(x)
        return session.forward(block_id, x, inference=inference)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        _synchronize_after_backward(ctx.session)
        (x,) = ctx.saved_tensors
        grad_x = ctx.session.backward(ctx.block_id, torch.cat([x, grad_out.to(x.dtype)], dim=1))
        return (None, None, None, *grad_x.split(ctx.widths, dim=1))


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
        tail = self.__dict__.get("_tail")
        if tail is not None:  # its decoder layer's tail runs whole: this is its call
            return tail.mlp(x)
        served = _WHOLE.get(self)
        if served is not None and _frozen(self.gate_proj) and _frozen(self.up_proj) and _frozen(self.down_proj):
            return _whole(x, *served)
        return layers_forward(self, x)

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})


@torch.compiler.disable  # a call to the executor: a graph break in a compiled client, as every layer call is
def _whole(x: torch.Tensor, block_id: str, session) -> torch.Tensor:
    out = _BlockCall.apply(session, block_id, not torch.is_grad_enabled(), x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


def _base_of(o_proj: nn.Module) -> nn.Module:
    """o_proj's virtual base layer: PEFT's LoRA wraps it, a frozen o_proj is it."""
    return o_proj.base_layer if type(o_proj) is LoraLinear else o_proj


def _additive(o_proj: nn.Module) -> bool:
    """o_proj's output is its base layer's plus what the tenant's adapter adds to it (or the base layer's alone): a
    frozen virtual layer, or PEFT's plain LoRA over one (no variant such as DoRA, which rescales the sum)."""
    if type(o_proj) is LoraLinear:
        return _frozen(o_proj.base_layer) and not o_proj.merged and \
            not any(name in o_proj.lora_variant for name in o_proj.active_adapters)
    return _frozen(o_proj)


# decoder layer -> (tail id, session, the norm's weight as built and its version), as `_WHOLE`
_TAILS: "weakref.WeakKeyDictionary[nn.Module, tuple[str, object, torch.Tensor, int]]" = weakref.WeakKeyDictionary()


def serve_tail(layer: nn.Module, tail_id: str, session) -> None:
    """Run `layer`'s tail (o_proj to the MLP's residual) as the executor's block `tail_id` whenever it may: o_proj
    additive, the post-attention norm the base's untouched (its weight the one built, never written, not trained
    while gradients are on: the executor normalizes with its own copy), the MLP served whole and frozen, no hook on
    them, the layer not being compiled; checked at each call."""
    norm = layer.post_attention_layernorm
    _TAILS[layer] = (tail_id, session, norm.weight, norm.weight._version)
    layer.__class__ = _served_tail(type(layer))
    norm.__class__ = _passing_when_tail(type(norm))


def _tail_served(layer: nn.Module):
    served = _TAILS.get(layer)
    if served is None or torch.compiler.is_compiling():  # (a compiled layer calls o_proj and its MLP block: a graph
        return None  # would keep one check's answer, and the stand-ins' state is no graph's)
    _, _, weight, version = served
    norm, mlp, o_proj = layer.post_attention_layernorm, layer.mlp, layer.self_attn.o_proj
    if norm.weight is not weight or weight._version != version or (weight.requires_grad and torch.is_grad_enabled()):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (norm, mlp, o_proj, _base_of(o_proj))) or \
            _WHOLE.get(mlp) is None:
        return None  # a hook would see the tail's stand-ins (and a copy of the MLP is the tenant's)
    if not (_frozen(mlp.gate_proj) and _frozen(mlp.up_proj) and _frozen(mlp.down_proj) and _additive(o_proj)):
        return None
    return served


class _TailPass:
    """One forward of a decoder layer whose tail runs whole: the three steps it must take, in order."""

    def __init__(self, layer: nn.Module, served):
        self.layer_name, (self.tail_id, self.session, _, _) = type(layer).__name__, served
        self.attention = None  # o_proj's input a
        self.residual = None  # the norm's input h
        self.result = None  # the MLP's: d

    def o_proj(self, a: torch.Tensor) -> torch.Tensor:
        self._expect(self.attention is None and self.residual is None, "o_proj")
        self.attention = a
        return a.new_zeros(*a.shape[:-1], self.session.block_specs[self.tail_id].out_features)

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        self._expect(self.attention is not None and self.residual is None, "post_attention_layernorm")
        self.residual = h
        return h

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        self._expect(self.residual is not None and x is self.residual and self.result is None, "mlp")
        h, a = self.residual, self.attention
        d = _BlockCall.apply(self.session, self.tail_id, not torch.is_grad_enabled(), h.reshape(-1, h.shape[-1]),
                             a.reshape(-1, a.shape[-1]))
        self.result = d.view(*h.shape[:-1], d.shape[-1])
        return self.result

    def _expect(self, ok: bool, step: str) -> None:
        if not ok:
            raise SymbiosisError(f"{self.layer_name} {self.tail_id!r} called {step} out of the order its tail is served "
                                 "in (o_proj, post_attention_layernorm, then mlp on the norm's output)")


@functools.cache
def _served_tail(cls: type) -> type:
    """A decoder layer class whose forward runs its tail whole when `_tail_served` says it may (its own forward, the
    three steps rerouted for its duration; a layer that did not take all three raises: no half-served layer)."""
    layers_forward = cls.forward

    def forward(self, *args, **kwargs):
        served = _tail_served(self)
        if served is None:
            return layers_forward(self, *args, **kwargs)
        tail = _TailPass(self, served)
        base = _base_of(self.self_attn.o_proj)
        base.deferred, self.post_attention_layernorm._tail, self.mlp._tail = tail.o_proj, tail, tail
        try:
            out = layers_forward(self, *args, **kwargs)
        finally:
            base.deferred, self.post_attention_layernorm._tail, self.mlp._tail = None, None, None
        tail._expect(tail.result is not None, "(the MLP not at all)")
        return out

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})


@functools.cache
def _passing_when_tail(cls: type) -> type:
    """A norm class that returns its input while its decoder layer's tail runs whole (the executor normalizes)."""
    norm_forward = cls.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tail = self.__dict__.get("_tail")
        return norm_forward(self, x) if tail is None else tail.norm(x)

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})

