"""The executor: serves forward / backward / fetch / weight_norms calls of attached clients on the base weights.

It keeps no per-call state: backward needs only the output gradient (grad_x = g W), so calls of any
client may arrive in any order, and a client that vanishes leaves nothing behind but its id.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import threading
from concurrent.futures import Future
from typing import Callable

import torch

from symbiosis.errors import BadCall, CheckpointError, ExecutorOutOfMemory, FingerprintMismatch, UnknownClient, UnknownLayer
from symbiosis.executor.batcher import Batcher
from symbiosis.executor.policy import Policy, make_policy
from symbiosis.executor.stats import ExecutorStats
from symbiosis.executor.store import BaseLayer, BaseWeights, check_finite
from symbiosis.model.checkpoint import Checkpoint
from symbiosis.model.partition import (
    GROUP_SEPARATOR,
    BaseLayerSpec,
    architecture_class,
    build_skeleton,
    check_complete,
    load_config,
    all_base_layers,
    plan_decoder_tails,
    plan_gated_mlps,
)
from symbiosis.model.layout import Layout
from symbiosis.protocol import DEFAULT_MAX_CALL_TOKENS, OPS, check_call, check_counts
from symbiosis.torch_dtypes import resolve_dtype



def _out_of_memory(error: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator a plain RuntimeError saying so."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error) or \
        "not enough memory" in str(error)


def read_skeleton(path, dtype=None, torch_dtype=None, auto_class=None):
    """(checkpoint, skeleton, layout, dtype) of the model in `path`: its skeleton built on the meta device and the
    whole checkpoint checked, client tensors too, before anything is read or computed."""
    checkpoint = Checkpoint(path)
    config = load_config(checkpoint)
    dtype = resolve_dtype(dtype, torch_dtype, config)
    skeleton = build_skeleton(config, auto_class or architecture_class(config), dtype)
    layout = Layout(skeleton, checkpoint)
    check_complete(skeleton, layout)
    return checkpoint, skeleton, layout, dtype


def _base_module(skeleton_module: torch.nn.Module, name: str, layout: Layout, device, dtype) -> torch.nn.Module:
    """A copy of the skeleton's module `name` (a norm) holding the checkpoint's tensors, frozen, on `device`."""
    module = copy.deepcopy(skeleton_module).to_empty(device=device).requires_grad_(False)
    for param_name, param in module.named_parameters():
        tensor_name = layout.names.get(f"{name}.{param_name}")
        if tensor_name is None:
            raise CheckpointError(f"{layout.checkpoint.listing}: no tensor for {name}.{param_name}")
        tensor = layout.read({tensor_name: dtype}, device)[tensor_name]
        if tensor.shape != param.shape:
            raise CheckpointError(f"{layout.checkpoint.listing}: {layout.keys(tensor_name)} make {tensor_name!r} of "
                                  f"shape {list(tensor.shape)}, the config implies {list(param.shape)}")
        check_finite(layout, tensor_name, tensor)
        param.data.copy_(tensor)
    return module


def read_base_plan(path, dtype=None, torch_dtype=None, auto_class=None):
    """(checkpoint, layout, every base layer's spec, dtype) of the model in `path` (`read_skeleton`)."""
    checkpoint, skeleton, layout, dtype = read_skeleton(path, dtype, torch_dtype, auto_class)
    return checkpoint, layout, all_base_layers(skeleton, layout), dtype


class Executor:
    """Holds the base layers of one checkpoint and serves them to clients.

    >>> executor = Executor.from_pretrained(path, device="cuda:0", dtype=torch.bfloat16)
    """

    def __init__(self, checkpoint: Checkpoint, weights: BaseWeights, fingerprint: str,
                 device: torch.device, dtype: torch.dtype, max_call_tokens: int = DEFAULT_MAX_CALL_TOKENS,
                 policy: Policy | str = "opportunistic"):
        self.checkpoint = checkpoint
        self.weights = weights
        self.fingerprint = fingerprint
        self.device = device
        self.dtype = dtype
        self.max_call_tokens = max_call_tokens
        self.clients: dict[str, str] = {}  # client id -> name the client gave
        self._client_ids = itertools.count()
        self._lock = threading.Lock()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.stats = ExecutorStats(device)
        self.batcher = Batcher(self._run_batch, self.policy, lambda: len(self.clients), self.stats,
                               getattr(weights, "home_stream", None))  # layers on other GPUs (executor/peers.py)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str | None = None, *, torch_dtype=None, auto_class=None,
                        max_call_tokens: int = DEFAULT_MAX_CALL_TOKENS,
                        policy: Policy | str = "opportunistic") -> "Executor":
        """Read only the base tensors of the model in `path` onto `device`.

        `auto_class` defaults to the class named in config.json's `architectures`, which covers every
        tensor of the checkpoint; `dtype` defaults to the config's dtype (`torch_dtype` is its deprecated alias).
        `policy`: how calls of different clients are batched (`opportunistic`, `lockstep`, `none`, or a Policy).
        """
        checkpoint, skeleton, layout, dtype = read_skeleton(path, dtype, torch_dtype, auto_class)
        fingerprint = checkpoint.fingerprint()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # compare equal to tensors' devices
        specs = all_base_layers(skeleton, layout)
        weights = BaseWeights(layout, specs, device, dtype)
        by_id = {spec.layer_id: spec for spec in specs}
        mlps = plan_gated_mlps(skeleton, by_id)  # (it skips experts' specs)
        tails = plan_decoder_tails(skeleton, by_id, mlps)
        modules = {block_id: skeleton.get_submodule(block_id).act_fn for block_id in mlps}
        for tail_id, spec in tails.items():  # its norm: the last part of its weight_name
            norm = spec.weight_name.rpartition(GROUP_SEPARATOR)[2]
            modules[tail_id] = _base_module(skeleton.get_submodule(norm), norm, layout, device, dtype)
        weights.serve_blocks(mlps | tails, modules)
        return cls(checkpoint, weights, fingerprint, device, dtype, max_call_tokens, policy)

    @functools.cached_property
    def widest(self) -> int:
        """The widest input or output of any call: a layer's, or a group's (its sibling layers' outputs side
        by side)."""
        siblings: dict[str, int] = {}
        for spec in self.layer_specs.values():
            parent = spec.layer_id.rpartition(".")[0]
            siblings[parent] = siblings.get(parent, 0) + spec.out_features
        return max([max(s.in_features, s.out_features) for s in self.layer_specs.values()] + list(siblings.values()) +
                   [s.in_features + s.out_features for s in self.block_specs.values()])  # a block's backward: [x | g]

    @property
    def layer_specs(self) -> dict[str, BaseLayerSpec]:
        return {layer_id: layer.spec for layer_id, layer in self.weights.layers.items()}

    @property
    def block_specs(self) -> dict[str, BaseLayerSpec]:
        """The gated MLPs this executor runs whole, by id (a sharded executor's weights have none)."""
        return {block_id: block.spec for block_id, block in getattr(self.weights, "blocks", {}).items()}

    # --- clients -------------------------------------------------------------------------------------

    def attach(self, fingerprint: str, name: str = "client", device=None):
        """Admit a client built from the checkpoint with this fingerprint; returns its session."""
        from symbiosis.transport.inprocess import InProcessSession

        return InProcessSession(self, self.register(fingerprint, name))

    def register(self, fingerprint: str, name: str) -> str:
        if fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"client {name!r} was built from a different checkpoint than this executor serves "
                f"(client fingerprint {fingerprint[:16]}…, executor {self.fingerprint[:16]}… from "
                f"{self.checkpoint.path}); both sides must load the same model directory"
            )
        with self._lock:
            client_id = f"{name}-{next(self._client_ids)}"
            self.clients[client_id] = name
        return client_id

    def detach(self, client_id: str) -> None:
        """Forget a client: its queued calls are dropped, and batching stops waiting for it."""
        with self._lock:
            self.clients.pop(client_id, None)
        self.stats.forget(client_id)
        self.batcher.drop_client(client_id)

    def close(self) -> None:
        self.batcher.close()

    def stats_snapshot(self, only: set[str] | None = None) -> dict:
        """Every figure, or (`only`: a tenant's clients) just those clients' own."""
        return self.stats.snapshot(self.clients, only)

    # --- calls ---------------------------------------------------------------------------------------

    def _layer_for(self, client_id: str, layer_id: str, groups: bool = True) -> BaseLayer:
        if client_id not in self.clients:
            raise UnknownClient(f"client {client_id!r} is not attached to this executor")
        layer = self.weights.get(layer_id) if groups else self.weights.layers.get(layer_id)
        if layer is None:
            raise UnknownLayer(f"this executor serves no base layer {layer_id[:300]!r}")
        return layer

    def submit(self, client_id: str, op: str, layer_id: str, tensor: torch.Tensor, inference: bool = False,
               inline: bool = False, gate: Callable[[], None] | None = None) -> Future:
        """Queue one call; the future resolves to its output on the executor's device.

        forward:        x [T, in]  -> x W^T + b  [T, out]
        forward_nobias: x [T, in]  -> x W^T      [T, out]
        backward:       g [T, out] -> g W        [T, in]
        A bad call raises here, before it is queued, so it can never spoil a batch.
        `gate`: queues on the executor's stream what the input must wait for (a pipelined client's flag).
        """
        self._check(client_id, op, layer_id, tensor)
        return self._queue(client_id, op, layer_id, tensor, inference, inline, gate)

    def submit_experts(self, client_id: str, op: str, group_id: str, tensor: torch.Tensor, counts: list[int],
                       inference: bool = False, inline: bool = False, gate: Callable[[], None] | None = None) -> Future:
        """Queue one call of every expert of a fused MoE projection (`group_id`: its tensor's name), `tensor` grouped
        by expert, `counts[e]` rows for expert e; ops and shapes as `submit`'s, per expert. Calls of several
        clients for one projection are batched: their rows regrouped by expert, one grouped GEMM."""
        self._check(client_id, op, group_id, tensor, counts)
        return self._queue(client_id, op, group_id, tensor, inference, inline, gate, counts)

    def run_alone(self, client_id: str, op: str, layer_id: str, tensor: torch.Tensor,
                  counts: list[int] | None = None) -> torch.Tensor:
        """One call (a layer's, or with `counts` a MoE projection's experts'), checked as `submit` checks it, run
        now on this thread's stream, batched with nothing: for a client the executor serves alone, whose input
        may still be on its way there (an `nccl://` client's chained calls, transport/collective.py)."""
        self._check(client_id, op, layer_id, tensor, counts)
        if tensor.dtype != self.dtype or tensor.device != self.device:
            raise BadCall(f"{op} call to layer {layer_id!r} expects {self.dtype} on {self.device}")
        self.stats.count_direct((layer_id, op), tensor.shape[0], client_id)
        return self._run_batch((layer_id, op), tensor, counts)

    def _check(self, client_id: str, op: str, layer_id: str, tensor: torch.Tensor,
               counts: list[int] | None = None) -> None:
        """A call's op, client, layer (or experts' group, with `counts`) and shape, as the executor serves them."""
        if op not in OPS:
            raise BadCall(f"unknown op {op!r}; expected one of {OPS}")
        if counts is None:
            check_call(layer_id, self._layer_for(client_id, layer_id).spec, op, tensor, self.max_call_tokens)
            return
        if client_id not in self.clients:
            raise UnknownClient(f"client {client_id!r} is not attached to this executor")
        group = self.weights.experts.get(layer_id)
        if group is None:
            raise UnknownLayer(f"this executor serves no experts {layer_id[:300]!r} as one group")
        check_call(layer_id, group.spec, op, tensor, self.max_call_tokens)
        check_counts(layer_id, op, counts, group.num_experts, tensor.shape[0])

    def _queue(self, client_id: str, op: str, layer_id: str, tensor: torch.Tensor, inference: bool, inline: bool,
               gate: Callable[[], None] | None, segments: list[int] | None = None) -> Future:
        """A checked call (but its dtype) into the batcher, on the executor's device."""
        if tensor.dtype != self.dtype:
            raise BadCall(f"{op} call to layer {layer_id!r} expects {self.dtype}, got {tensor.dtype}")
        # non_blocking: from page-locked memory (a pinned transport buffer) the copy is queued on the stream
        # that computes with it; from pageable memory it is synchronous either way.
        tensor = tensor if tensor.device == self.device else tensor.to(self.device, non_blocking=True)
        tensor = tensor.detach() if tensor.requires_grad else tensor  # the executor records no autograd graph
        self.stats.count_client(client_id, tensor.shape[0])
        return self.batcher.submit(client_id, (layer_id, op), tensor, inference and op != "backward", inline, gate,
                                   segments=segments)

    def forward(self, client_id: str, layer_id: str, x: torch.Tensor, inference: bool = False,
                with_bias: bool = True) -> torch.Tensor:
        op = "forward" if with_bias else "forward_nobias"
        return self.submit(client_id, op, layer_id, x, inference, inline=True).result()

    def backward(self, client_id: str, layer_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        return self.submit(client_id, "backward", layer_id, grad_out, inline=True).result()

    def _run_batch(self, key: tuple[str, str], tensor: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        layer_id, op = key
        layer = self.weights.get(layer_id) if counts is None else self.weights.experts[layer_id]
        extra = () if counts is None else (counts,)
        try:
            # No autograd graph: the weights never require grad, and neither does what reaches here (a remote
            # call's buffer, or an in-process call made inside an autograd Function); cheaper than no_grad().
            if op == "backward":
                return layer.backward(tensor, *extra)
            return layer.forward(tensor, *extra, op == "forward")
        except (torch.OutOfMemoryError, RuntimeError) as e:  # the batcher then retries each call of a batch alone
            if not _out_of_memory(e):
                raise
            reason = str(e).splitlines()[0] if str(e) else "out of memory"
            raise ExecutorOutOfMemory(
                f"the executor's {self.device} has no memory for {tensor.shape[0]} tokens of {op} on {layer_id!r} "
                f"({reason}); send fewer tokens per call (a smaller batch) or free memory on the executor") from e

    def fetch(self, client_id: str, layer_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A copy of a base layer's weight and bias (public base weights; for PEFT's `modules_to_save`)."""
        layer = self._layer_for(client_id, layer_id, groups=False)
        return layer.weight.clone(), None if layer.bias is None else layer.bias.clone()

    def weight_norms(self, client_id: str, layer_id: str) -> torch.Tensor:
        """||W_o||^2 for every output feature o of a base layer [out] (a public fact about the base, which DoRA's
        weight normalisation needs; computed once per layer), at least float32."""
        return self._layer_for(client_id, layer_id, groups=False).squared_norms
