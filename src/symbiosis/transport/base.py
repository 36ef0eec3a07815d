"""The boundary between a client and an executor: the `Session` every transport implements.

A client (`client/`) holds one session and calls nothing else of the executor. Every transport (in-process,
`tcp://`, `ipc://`, pipelined `ipc://`) and every wrapper of one (`client/privacy.py`) is a `Session`, so a
client's code never asks which kind it holds.

Shapes: T tokens; `in`/`out` the layer's (or group's: sibling layer ids joined by "+", their outputs side by
side) input and output widths; tensors in the client's dtype and on its device, cast at the boundary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from symbiosis.model.partition import BaseLayerSpec


class Session(ABC):
    """A client's attachment to an executor.

    `client_id`: the executor's name for it. `layer_specs`: the base layers the executor serves, by id.
    `dtype`: the executor's compute dtype.
    """

    client_id: str
    layer_specs: dict[str, BaseLayerSpec]
    dtype: torch.dtype
    # the gated MLPs this client calls whole (`protocol.py`: kind gated_mlp; client/blocks.py), by id: those the
    # executor serves, through sessions whose calls carry tensors to another device or host (`RemoteSession.
    # whole_blocks`); none through a masking session (the activation is not linear in the noise)
    block_specs: dict[str, BaseLayerSpec] = {}

    @abstractmethod
    def forward(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        """x [T, in] -> x W^T + b [T, out].

        Semantics: the executor's result, exactly what the layer computes; `inference` marks a call no
        backward will follow (the executor serves those ahead of queued training calls). Raises the
        call's error (`BadCall`, `UnknownLayer`, `ExecutorOutOfMemory`, `ExecutorUnavailable`), or, for a
        pipelined session, may return at once and raise it at the next `synchronize`."""

    @abstractmethod
    def forward_nobias(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        """x [T, in] -> x W^T [T, out]. Semantics: as `forward`, without the bias."""

    @abstractmethod
    def backward(self, layer_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        """g [T, out] -> g W [T, in]. Semantics: the input gradient only; the executor keeps nothing from
        the forward call, and forms no gradient for W or b."""

    @abstractmethod
    def fetch(self, layer_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A single layer's (W, b), copies (public base weights, for PEFT's `modules_to_save`)."""

    @abstractmethod
    def weight_norms(self, layer_id: str) -> torch.Tensor:
        """||W_o||^2 for every output feature o of a single layer [out], at least float32 (DoRA)."""

    @abstractmethod
    def close(self) -> None:
        """Detach. Semantics: idempotent; afterwards calls raise."""

    def direct(self, layer_id: str, x: torch.Tensor):
        """The executor's own layer object, when this client may run the call itself (same process, device
        and dtype, nobody to batch with); None otherwise. Semantics: its `forward`/`backward` compute what
        the calls would, with native autograd, and the call is counted as the executor's."""
        return None

    def base_tensor(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The executor's own tensor read as `name`, if this client may hold it by reference (same process,
        shape, dtype and device: a tied embedding); None otherwise."""
        return None

    def synchronize(self, gpu: bool = False) -> None:
        """Semantics: once it returns, every call made so far is answered (and, with `gpu`, its result is on
        the client's GPU), or the first error among them is raised. A no-op where calls are answered before
        they return."""

    def reconnect(self) -> None:
        """Attach again to an executor that restarted, keeping the client's own state (remote sessions)."""
        raise NotImplementedError(f"{type(self).__name__} cannot reconnect")
