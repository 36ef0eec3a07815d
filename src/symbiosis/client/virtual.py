"""Virtual base layers: real `nn.Linear` / `Conv1D` instances whose weights live in the executor.

PEFT and other tooling wrap these unchanged, since they are instances of the classes they expect and their
`weight` reports the right shape, dtype and device. The weight holds no storage: any attempt to read its
values raises `VirtualWeightAccess` naming the layer (this is how merging and weight-based adapter inits
are refused instead of silently computing with garbage; `client/peft_support.py` refuses them earlier, by
config, and rewrites the PEFT methods whose math allows it, DoRA among them). The bias is a real, frozen
copy: it is small and public, and some methods subtract it from the base output.

Forward sends the activations to the executor; backward sends the output gradient and receives
grad_input = grad_output . W (linear) or grad_output . W^T (conv1d). The executor keeps no activations,
and no gradient is ever computed for a base weight.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from transformers.pytorch_utils import Conv1D

from symbiosis.errors import VirtualWeightAccess
from symbiosis.model.partition import BaseLayerSpec

# Ops that only change a tensor's metadata: answered without data.
_METADATA_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.empty_like.default,
}


class VirtualWeight(torch.Tensor):
    """A base weight's shape, dtype and device, without its values (which only the executor holds)."""

    layer_id: str

    @staticmethod
    def __new__(cls, shape, dtype, device, layer_id: str, requires_grad: bool = False):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t.layer_id = layer_id
        return t

    def __repr__(self) -> str:
        return f"VirtualWeight(layer={self.layer_id!r}, shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))  # torch.cat takes a list of tensors
        source = next(a for a in flat if isinstance(a, VirtualWeight))
        if func in _METADATA_OPS:
            dtype = kwargs.get("dtype") or source.dtype
            device = kwargs.get("device") or source.device
            return VirtualWeight(source.shape, dtype, device, source.layer_id)
        raise VirtualWeightAccess(
            f"the base weight of layer {source.layer_id!r} is held by the symbiosis executor, not by this client; "
            f"`{func}` needs its values. Methods that read base weights (DoRA's weight norm, merge_and_unload, "
            "PiSSA/OLoRA/LoftQ/EVA initialisation) cannot run on a split model; use them on a plain model."
        )

    # Autograd and module bookkeeping (Parameter(), deepcopy) go through these before dispatch.
    def __deepcopy__(self, memo):
        return VirtualWeight(self.shape, self.dtype, self.device, self.layer_id, self.requires_grad)

    __torch_function__ = torch._C._disabled_torch_function_impl


class _BaseLayerCall(torch.autograd.Function):
    """y = executor.forward(layer, x) (or forward_nobias); backward: grad_x = executor.backward(layer, grad_y).
    Nothing saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, session, layer_id: str, inference: bool, with_bias: bool) -> torch.Tensor:
        ctx.session, ctx.layer_id = session, layer_id
        if with_bias:
            return session.forward(layer_id, x, inference=inference)
        return session.forward_nobias(layer_id, x, inference=inference)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        _synchronize_after_backward(ctx.session)
        return ctx.session.backward(ctx.layer_id, grad_out), None, None, None, None


_SYNC_QUEUED: set[int] = set()  # sessions whose synchronize() is queued for the end of the running pass


def _synchronize_after_backward(session) -> None:
    """Once per backward pass and session: when autograd finishes the pass, wait until every call of it is
    answered and on this GPU (a pipelined session's calls return before that; a no-op for others), so the
    optimizer never sees gradients computed from results an executor that died never sent."""
    key = id(session)
    if key in _SYNC_QUEUED or torch._C._current_graph_task_id() == -1:
        return
    _SYNC_QUEUED.add(key)

    def synchronize():
        _SYNC_QUEUED.discard(key)
        session.synchronize(gpu=True)

    torch.autograd.Variable._execution_engine.queue_callback(synchronize)


def call_executor(session, tokens: torch.Tensor, layer_id: str, inference: bool, with_bias: bool = True) -> torch.Tensor:
    """One executor call with autograd: tokens [T, in] -> [T, out] (layer_id may name a group)."""
    return _BaseLayerCall.apply(tokens, session, layer_id, inference, with_bias)


def base_call(layer: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """One forward call of a virtual layer outside autograd, for a caller that does its own backward (the
    chunked loss's frozen head): (y [T, out], grad_y -> grad_x). The executor's GEMM on this thread where the
    session allows it (counted as the one forward call it is), else a call and a backward call."""
    direct = layer.session.direct(layer.layer_id, tokens)
    if direct is not None:
        return direct.forward(tokens), direct.backward
    return layer.session.forward(layer.layer_id, tokens), partial(layer.session.backward, layer.layer_id)


def base_forward(layer: nn.Module, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """A virtual layer's y = x W^T (+ b) through the executor, with autograd: x [..., in] -> [..., out].
    Without the bias it is a call of its own (PEFT's DoRA needs x W^T of a dropped-out input). A bias the
    client trains (PEFT's `bias="all"`) is the client's copy, added here to a bias-free call."""
    own_bias = layer.bias if with_bias and layer.bias is not None and layer.bias.requires_grad else None
    if own_bias is not None:
        return base_forward(layer, x, with_bias=False) + own_bias
    leading = x.shape[:-1]
    tokens = x.reshape(-1, x.shape[-1])
    direct = layer.session.direct(layer.layer_id, tokens)
    inference = not torch.is_grad_enabled()
    if direct is not None:  # in-process executor, nobody to batch with: its GEMM on this thread
        out = direct.forward(tokens, with_bias)
    elif layer.grouper is not None and with_bias:
        out = layer.grouper.call(layer.layer_id, x, tokens, inference)
    else:
        out = call_executor(layer.session, tokens, layer.layer_id, inference, with_bias)
    return out.view(*leading, out.shape[-1])


def _init_virtual(layer: nn.Module, spec: BaseLayerSpec, session, grouper, device, dtype) -> None:
    nn.Module.__init__(layer)
    layer.layer_id = spec.layer_id
    layer.session = session
    layer.grouper = grouper
    layer.deferred = None  # x -> what to return instead of calling the executor (client/blocks.py: a decoder tail)
    shape = (spec.out_features, spec.in_features) if spec.kind == "linear" else (spec.in_features, spec.out_features)
    layer.weight = nn.Parameter(VirtualWeight(shape, dtype, device, spec.layer_id), requires_grad=False)
    # The bias is a public fact about the base of [out] values: the client holds a frozen copy (read with its own
    # tensors), for the PEFT methods that take it out of the base output and put it back (BOFT, DoRA). The
    # executor still adds its own in every forward call.
    layer.bias = nn.Parameter(torch.empty(spec.out_features, dtype=dtype, device="meta"), requires_grad=False) \
        if spec.bias_name else None


def _materialize(layer: nn.Module, real: nn.Module, memo) -> nn.Module:
    """A deep copy of a virtual layer is a real, client-owned layer holding a copy of the base weights:
    what PEFT's `modules_to_save` needs to train a base layer fully."""
    weight, bias = layer.session.fetch(layer.layer_id)
    real.weight = nn.Parameter(weight.to(layer.weight.device, layer.weight.dtype), requires_grad=layer.weight.requires_grad)
    if layer.bias is not None:
        real.bias = nn.Parameter(bias.to(layer.bias.device, layer.bias.dtype), requires_grad=layer.bias.requires_grad)
    memo[id(layer)] = real
    return real


class VirtualLinear(nn.Linear):
    """An `nn.Linear` whose y = x W^T + b runs in the executor."""

    def __init__(self, spec: BaseLayerSpec, session, grouper=None, device=None, dtype=None):
        _init_virtual(self, spec, session, grouper, device, dtype)
        self.in_features, self.out_features = spec.in_features, spec.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deferred is not None:  # its decoder layer's tail runs it with the MLP (client/blocks.py)
            return self.deferred(x)
        return base_forward(self, x)

    def __deepcopy__(self, memo):
        real = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        return _materialize(self, real, memo)

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id!r}, " + super().extra_repr()


class VirtualConv1D(Conv1D):
    """A transformers `Conv1D` (GPT-2 style, W: [in, out]) whose y = x W + b runs in the executor."""

    def __init__(self, spec: BaseLayerSpec, session, grouper=None, device=None, dtype=None):
        _init_virtual(self, spec, session, grouper, device, dtype)
        self.nx, self.nf = spec.in_features, spec.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return base_forward(self, x)

    def __deepcopy__(self, memo):
        with torch.device("meta"):
            real = Conv1D(self.nf, self.nx)
        return _materialize(self, real, memo)

    def __repr__(self) -> str:
        return f"VirtualConv1D(layer_id={self.layer_id!r}, nf={self.nf}, nx={self.nx})"


def make_virtual(spec: BaseLayerSpec, session, grouper, device, dtype) -> nn.Module:
    cls = VirtualLinear if spec.kind == "linear" else VirtualConv1D
    return cls(spec, session, grouper, device=device, dtype=dtype)
