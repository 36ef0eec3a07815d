"""The in-process transport: a client and the executor in one process, tensors passed by reference."""

from __future__ import annotations

import torch

from symbiosis.executor.executor import Executor
from symbiosis.executor.store import BaseLayer
from symbiosis.transport.base import Session


class InProcessSession(Session):
    """A client's handle on an executor in the same process: plain calls, tensors passed by reference.
    Group ids ("a+b+c", see `BaseWeights`) are accepted wherever a layer id is.

    Casts at the boundary: activations go in the executor's dtype and device, results come back in the
    client's (a float32 CPU client may use a bfloat16 GPU executor).
    """

    def __init__(self, executor: Executor, client_id: str):
        self.executor = executor
        self.client_id = client_id
        # True for a client whose calls are never worth batching with other clients' (the hosted engine: each of
        # its steps is already the batch of its requests): it runs the executor's layers on its own thread always
        self.own_gemms = False
        self.layer_specs = executor.layer_specs
        # (no gated MLPs whole: tensors pass by reference here, and the executor's GEMMs would grow by a
        # recomputation of gate and up in every backward; `Executor.block_specs` are served to remote clients)
        self.dtype = executor.dtype
        self._layers = executor.weights.layers

    def direct(self, layer_id: str, x: torch.Tensor) -> BaseLayer | None:
        """The executor's own layer, for the client to run on its thread (and CUDA stream), when the
        executor would run the call alone anyway (nobody else is attached to batch with, or the policy is
        `none`) and the client computes on the executor's device in its dtype. Native autograd then does
        backward: W does not require grad, so grad_x = g W is all it computes, and it saves no activation
        (only a reference to W). The call is counted in the executor's stats, except inside a
        `torch.compile`d model, whose traced graph would replay a count taken once.

        Clients on threads of their own thus share the executor's weights without any hand-off, and a
        compiled client traces the GEMMs along with its own ops (docs/ARCHITECTURE.md)."""
        executor = self.executor
        if not self._runs_here(x):
            return None
        layer = self._layers.get(layer_id)
        if layer is not None and not getattr(layer, "local", True):
            return None  # on a shard of a sharded executor: a round trip autograd cannot see through
        if layer is not None and not torch.compiler.is_compiling():
            executor.stats.count_direct((layer_id, "forward"), x.shape[0], self.client_id)
        return layer

    def expert_group(self, group_id: str, x: torch.Tensor | None = None):
        """Whether the executor runs the experts of fused MoE projection `group_id` as one call (None: call them
        one by one). With `x`: their `ExpertGroup` itself, for this thread to run, as `direct` (else None)."""
        group = self.executor.weights.experts.get(group_id)
        if x is None or group is None:
            return group
        if not self._runs_here(x):
            return None
        if not torch.compiler.is_compiling():
            self.executor.stats.count_direct((group_id, "forward"), x.shape[0], self.client_id)
        return group

    def _runs_here(self, x: torch.Tensor) -> bool:
        """Whether this client runs a call on `x` itself: the executor would run it alone anyway, and `x` is on its
        device in its dtype."""
        executor = self.executor
        alone = self.own_gemms or len(executor.clients) == 1 or executor.policy.name == "none"
        return alone and x.device == executor.device and x.dtype == self.dtype

    def experts_forward(self, group_id: str, x: torch.Tensor, counts: list[int], inference: bool = False) -> torch.Tensor:
        future = self.executor.submit_experts(self.client_id, "forward", group_id, self._send(x), counts, inference,
                                              inline=True)
        return self._cast(future.result(), x)

    def experts_backward(self, group_id: str, grad_out: torch.Tensor, counts: list[int]) -> torch.Tensor:
        future = self.executor.submit_experts(self.client_id, "backward", group_id, self._send(grad_out), counts,
                                              inline=True)
        return self._cast(future.result(), grad_out)

    def base_tensor(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The executor's own tensor read as `name` (layout.Layout), when the client needs that very tensor
        in the same shape, dtype and device: a tied embedding, which the client then holds by reference
        instead of as a copy (`from_pretrained`)."""
        tensor = self.executor.weights.tensor(name)
        if tensor is None or (tensor.shape, tensor.dtype, tensor.device) != (like.shape, like.dtype, like.device):
            return None
        return tensor

    def _send(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.dtype == self.dtype else tensor.to(self.dtype)

    def _cast(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        same = result.device == like.device and result.dtype == like.dtype
        return result if same else result.to(like.device, like.dtype)

    def forward(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        return self._cast(self.executor.forward(self.client_id, layer_id, self._send(x), inference=inference), x)

    def forward_nobias(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        y = self.executor.forward(self.client_id, layer_id, self._send(x), inference, with_bias=False)
        return self._cast(y, x)

    def backward(self, layer_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        return self._cast(self.executor.backward(self.client_id, layer_id, self._send(grad_out)), grad_out)

    def fetch(self, layer_id: str):
        return self.executor.fetch(self.client_id, layer_id)

    def weight_norms(self, layer_id: str) -> torch.Tensor:
        return self.executor.weight_norms(self.client_id, layer_id)

    def close(self) -> None:
        self.executor.detach(self.client_id)
