"""The base layers over several GPUs of this one process: no shard processes, no messages, no host round trips.

    executor = on_devices("path/to/model", ["cuda:0", "cuda:1"], dtype=torch.bfloat16)

Placement as the sharded executor's (executor/sharded.py: whole decoder layers per device balanced by bytes, or
every layer's output columns over all devices), the front an ordinary `Executor` on the first device that clients
attach to over any transport. A layer on another GPU (a *peer*) is called as any other: its input is copied there
(NVLink where the GPUs have it), its GEMM queued on that GPU's stream, its output copied back, all queued on the
GPUs without the host waiting for any of it. Processes for the other devices (`launch_sharded`, torchrun) remain
the way over machines; on one machine this is the faster one (each call to a shard is five messages and a host
read of the answer's header there).

Streams: a batch for a peer's layers runs on a stream of the front's GPU of that peer's own (`home_stream`), the
copies in and out ordered there, so the front's own batches never wait for the peer's, and each caller's stream
waits for its own result only (executor/batcher.py). Calls for several layers thus keep every GPU busy at once.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from symbiosis.executor.executor import Executor, read_base_plan
from symbiosis.executor.sharded import _own, _plan, assemble_front
from symbiosis.executor.store import BaseWeights
from symbiosis.model.partition import BaseLayerSpec


class Peer:
    """A device beside the front's: its share of the weights, the stream its GEMMs run on, and the stream of the
    front's device its batches run on (None on the CPU, where there are no streams)."""

    def __init__(self, device: torch.device, front: torch.device, weights: BaseWeights):
        self.device, self.front, self.weights = device, front, weights
        self.compute = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.home = torch.cuda.Stream(front) if front.type == "cuda" else None

    def run(self, op, x: torch.Tensor) -> torch.Tensor:
        """op(x there), back here: x [T, d_in] on the front's device -> [T, d_out] on it."""
        with torch.cuda.stream(self.compute) if self.compute is not None else nullcontext():
            return op(x.to(self.device)).to(self.front)


@dataclass
class PeerLayer:
    """A base layer (or a group of sibling layers) held by a peer: `BaseLayer`'s interface, on the front's device.
    `local` False: a client never runs it on its own thread (store.BaseLayer's direct path)."""

    spec: BaseLayerSpec
    layer: object  # the peer's BaseLayer (or MemberLayers)
    peer: Peer
    local = False

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return self.peer.run(lambda there: self.layer.forward(there, with_bias), x)

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        return self.peer.run(self.layer.backward, grad_out)

    def group(self, layer_id: str) -> "PeerLayer | None":
        """Sibling layers of this peer as one call (`BaseWeights.get`'s group ids)."""
        layer = self.peer.weights.get(layer_id)
        return None if layer is None else PeerLayer(layer.spec, layer, self.peer)

    @property
    def squared_norms(self) -> torch.Tensor:
        return self.layer.squared_norms.to(self.peer.front)

    @property
    def weight(self) -> torch.Tensor:
        return self.layer.weight.to(self.peer.front)

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.layer.bias is None else self.layer.bias.to(self.peer.front)


def checked_devices(devices: list[str | torch.device]) -> list[torch.device]:
    """`devices` as torch devices, each a CPU or a GPU of this process; ValueError naming one that is not a device,
    not here, or a GPU listed twice (CPUs may repeat where no GPU is listed: tests)."""
    parsed = []
    for name in devices:
        try:
            parsed.append(torch.device(name))
        except (RuntimeError, TypeError):
            raise ValueError(f"{name!r} is not a device (cpu, cuda:0, ...)") from None
    if len(set(parsed)) < len(parsed) and any(d.type == "cuda" for d in parsed):
        raise ValueError(f"each GPU once: {', '.join(map(str, parsed))}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in parsed:
        if device.type == "cuda" and (device.index is None or device.index >= gpus):
            raise ValueError(f"no GPU {device} here ({gpus} GPUs): name each one with its index, cuda:0 to "
                             f"cuda:{max(0, gpus - 1)}")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{device}: symbiosis runs on CPUs and CUDA GPUs")
    return parsed


def on_devices(path, devices: list[str | torch.device], dtype=None, split: str = "layers",
               **executor_options) -> Executor:
    """An `Executor` on devices[0] whose base layers are spread over `devices` (this process's GPUs; CPUs too,
    for tests) by `split` ("layers" or "columns", as `sharded.front`)."""
    devices = checked_devices(devices)
    checkpoint, layout, specs, dtype = read_base_plan(path, dtype)
    whole, columns = _plan(specs, len(devices), split)
    shares = [_own(specs, rank, whole, columns) for rank in range(len(devices))]
    local = BaseWeights(layout, shares[0][0], devices[0], dtype, columns=shares[0][1])
    peers = [Peer(device, devices[0], BaseWeights(layout, mine, device, dtype, columns=slices))
             for device, (mine, slices) in zip(devices[1:], shares[1:])]
    elsewhere = lambda rank, spec: PeerLayer(spec, peers[rank - 1].weights.layers[spec.layer_id],  # noqa: E731
                                             peers[rank - 1])
    return assemble_front(checkpoint, local, specs, whole, columns, split, elsewhere, [], devices[0], dtype,
                          **executor_options)
