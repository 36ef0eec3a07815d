"""A sharded executor: the base layers spread over several devices (GPUs, or CPU processes), on torch.distributed.

    executor = launch_sharded("path/to/model", ["cuda:0", "cuda:1"], dtype=torch.bfloat16)  # its own launcher
    torchrun --nproc-per-node 2 -m symbiosis executor --model DIR --devices cuda:0,cuda:1 --listen tcp://...

Rank 0 is the *front*: an ordinary `Executor` that clients attach to over any transport, holding its share of
the layers. Every other rank is a *shard*: it reads only its own layers and answers the front's requests for
them. A call for a layer goes to where that layer lives; batching across clients stays on the front.

Placement (`split`): "layers", whole decoder layers per rank in contiguous runs balanced by bytes (`place`), the
layers outside the decoder stack (the head) on rank 0: a call is one point-to-point round trip to one rank.
"columns": every layer's output columns over all ranks (`split_columns`, a MoE expert's layers aside): a call goes
to every rank at once (`SplitLayer`). The multi-GPU issues measure which wins where.

Between the front and a shard (point-to-point send/recv; NCCL between GPUs, gloo where a CPU is involved):

    front -> shard:  int64 [op, rows, cols, len(layer id)], the layer id's bytes (uint8), the input [rows, cols]
    shard -> front:  int64 [status, rows, cols, len(message)], then the output [rows, cols] or the error's text

ops: forward, forward_nobias, backward (protocol.OPS), squared_norms, weight, bias, stop. A shard that dies
fails the calls for its layers with `ExecutorUnavailable` naming the rank (torch.distributed's timeout bounds a
shard that hangs); the front's own layers and the other shards keep serving.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from symbiosis.errors import ExecutorUnavailable, UnknownLayer
from symbiosis.executor.executor import Executor, read_base_plan
from symbiosis.executor.store import BaseWeights, MemberLayers
from symbiosis.model.partition import GROUP_SEPARATOR, BaseLayerSpec
from symbiosis.protocol import OPS

EXTRA_OPS = ("squared_norms", "weight", "bias", "stop")
ALL_OPS = OPS + EXTRA_OPS
DEFAULT_TIMEOUT_S = 120.0
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def place(specs: list[BaseLayerSpec], world_size: int) -> dict[str, int]:
    """layer id -> rank: decoder layers (`...layers.<i>....`) in contiguous runs of about equal bytes, one run per
    rank; layers outside the stack (the head) on rank 0."""
    size = lambda s: s.in_features * s.out_features  # noqa: E731 -- elements of its weight
    by_block: dict[int, int] = {}
    for spec in specs:
        match = _LAYER_INDEX.search("." + spec.layer_id + ".")
        if match is not None:
            block = int(match.group(1))
            by_block[block] = by_block.get(block, 0) + size(spec)
    blocks = sorted(by_block)
    total = sum(by_block.values()) or 1
    rank_of_block, done = {}, 0
    for block in blocks:  # the run a block falls in: by the bytes before its middle
        rank_of_block[block] = min(world_size - 1, int((done + by_block[block] / 2) * world_size / total))
        done += by_block[block]
    placement = {}
    for spec in specs:
        match = _LAYER_INDEX.search("." + spec.layer_id + ".")
        placement[spec.layer_id] = rank_of_block[int(match.group(1))] if match else 0
    return placement


def split_columns(specs: list[BaseLayerSpec], world_size: int) -> dict[str, list[tuple[int, int, int]]]:
    """layer id -> [(rank, first output column, columns)]: every layer (but a MoE expert's, placed whole by
    `place`) cut by its outputs into `world_size` runs of about equal width, rank r holding run r."""
    columns = {}
    for spec in specs:
        if spec.expert is None:
            bounds = [spec.out_features * r // world_size for r in range(world_size + 1)]
            columns[spec.layer_id] = [(r, bounds[r], bounds[r + 1] - bounds[r]) for r in range(world_size)
                                      if bounds[r + 1] > bounds[r]]
    return columns


def _backend(devices: list[torch.device]) -> str:
    return "nccl" if all(d.type == "cuda" for d in devices) else "gloo"


class _Link:
    """The front's end of its exchanges with one shard: one request and its answer at a time."""

    def __init__(self, rank: int, front_device: torch.device, backend: str, layers: int):
        self.rank, self.layers = rank, layers
        # gloo moves CPU tensors; NCCL the front's device's
        self.wire_device = front_device if backend == "nccl" else torch.device("cpu")
        self.lock = threading.Lock()
        self.lost: str | None = None

    def request(self, op: str, layer_id: str, tensor: torch.Tensor | None, dtype: torch.dtype,
                out_device: torch.device) -> torch.Tensor:
        with self.lock:
            self.guarded(self.post, op, layer_id, tensor)
            return self.guarded(self.collect, op, dtype, out_device)

    def guarded(self, step, *args):
        """One step of an exchange (the caller holds `lock` from post to collect)."""
        if self.lost is not None:
            raise ExecutorUnavailable(self.lost)
        try:
            return step(*args)
        except (RuntimeError, dist.DistBackendError) as e:  # the shard died, or stopped answering in time
            self.lost = (f"shard rank {self.rank} of the sharded executor (holding {self.layers} base layers) is "
                         f"gone: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            raise ExecutorUnavailable(self.lost) from e

    def post(self, op: str, layer_id: str, tensor: torch.Tensor | None) -> None:
        """Send a request; the shard starts on it while this thread posts to the others."""
        name = torch.frombuffer(bytearray(layer_id.encode()), dtype=torch.uint8) if layer_id else \
            torch.zeros(0, dtype=torch.uint8)
        rows, cols = tensor.shape if tensor is not None else (0, 0)
        header = torch.tensor([ALL_OPS.index(op), rows, cols, name.numel()], dtype=torch.int64)
        dist.send(header.to(self.wire_device), self.rank)
        if name.numel():
            dist.send(name.to(self.wire_device), self.rank)
        if tensor is not None:
            dist.send(tensor.to(self.wire_device).contiguous(), self.rank)

    def collect(self, op: str, dtype: torch.dtype, out_device: torch.device) -> torch.Tensor:
        """The answer to the request posted last."""
        if op == "stop":
            return torch.empty(0)
        answer = torch.empty(4, dtype=torch.int64, device=self.wire_device)
        dist.recv(answer, self.rank)
        status, rows, cols, length = answer.tolist()
        if status != 0:
            text = torch.empty(length, dtype=torch.uint8, device=self.wire_device)
            dist.recv(text, self.rank)
            message = bytes(text.cpu().tolist()).decode(errors="replace")
            raise UnknownLayer(message) if status == 2 else ExecutorUnavailable(f"shard rank {self.rank}: {message}")
        out = torch.empty(rows, cols, dtype=dtype if op != "squared_norms" else torch.promote_types(dtype, torch.float32),
                          device=self.wire_device)
        dist.recv(out, self.rank)
        return out.to(out_device)


@dataclass
class RemoteLayer:
    """A base layer (or a group of sibling layers) that lives on a shard: the same interface as `BaseLayer`, each
    call a round trip to it. `local` False: a client never runs it on its own thread (store.BaseLayer's direct
    path), since autograd could not see through the round trip."""

    spec: BaseLayerSpec
    link: _Link
    dtype: torch.dtype
    device: torch.device
    local = False

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return self.link.request("forward" if with_bias else "forward_nobias", self.spec.layer_id, x, self.dtype,
                                 self.device)

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        return self.link.request("backward", self.spec.layer_id, grad_out, self.dtype, self.device)

    @property
    def squared_norms(self) -> torch.Tensor:
        return self.link.request("squared_norms", self.spec.layer_id, None, self.dtype, self.device)[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.link.request("weight", self.spec.layer_id, None, self.dtype, self.device)

    @property
    def bias(self) -> torch.Tensor | None:
        if self.spec.bias_name is None:
            return None
        return self.link.request("bias", self.spec.layer_id, None, self.dtype, self.device)[0]


@dataclass
class SplitLayer:
    """A base layer cut by its output columns over the ranks (`split_columns`): each part is that rank's slice,
    a `BaseLayer` here or a `RemoteLayer` there. forward: x to every part at once, their outputs side by side;
    backward: each part its columns of the gradient, grad_x the sum of their answers."""

    spec: BaseLayerSpec
    parts: list  # (first column, part) in column order
    local = False

    def _run(self, op: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        remote = sorted(((part.link.rank, i) for i, (_, part) in enumerate(self.parts) if isinstance(part, RemoteLayer)))
        results: list = [None] * len(self.parts)
        locks = [self.parts[i][1].link.lock for _, i in remote]
        for lock in locks:  # in rank order: two split calls never wait on each other's links
            lock.acquire()
        try:
            for _, i in remote:
                link = self.parts[i][1].link
                link.guarded(link.post, op, self.spec.layer_id, inputs[i])
            for i, (_, part) in enumerate(self.parts):  # this rank's slices, while the shards compute theirs
                if not isinstance(part, RemoteLayer):
                    results[i] = part.backward(inputs[i]) if op == "backward" else part.forward(inputs[i],
                                                                                               op == "forward")
            for _, i in remote:
                part = self.parts[i][1]
                results[i] = part.link.guarded(part.link.collect, op, part.dtype, part.device)
        finally:
            for lock in locks:
                lock.release()
        return results

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        # x [T, in] -> [T, out]: every part's columns side by side
        return torch.cat(self._run("forward" if with_bias else "forward_nobias", [x] * len(self.parts)), dim=1)

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        # grad_out [T, out] -> [T, in]: the parts' g_r W_r summed
        pieces = [grad_out[:, first:first + part.spec.out_features].contiguous() for first, part in self.parts]
        partial = self._run("backward", pieces)
        total = partial[0].clone()
        for piece in partial[1:]:
            total += piece
        return total

    @property
    def squared_norms(self) -> torch.Tensor:
        return torch.cat([part.squared_norms for _, part in self.parts])

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([part.weight for _, part in self.parts], dim=0 if self.spec.kind == "linear" else 1)

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.spec.bias_name is None else torch.cat([part.bias for _, part in self.parts])


class ShardedWeights:
    """The front's view of every base layer: its own (`BaseWeights`) and the shards' (`RemoteLayer`s, or the
    `PeerLayer`s of other GPUs of this process, executor/peers.py)."""

    def __init__(self, local: BaseWeights, remote: dict[str, RemoteLayer], links: list[_Link]):
        self.local, self.links = local, links
        self.layers = {**local.layers, **remote}
        self.remote = remote
        self.nbytes = local.nbytes  # on this device; each shard holds its own share
        self.groups = local.groups
        self.experts = local.experts  # the front's; a shard's experts are called one by one
        self._homes: dict[str, object] = {}  # layer id -> home_stream's answer

    def home_stream(self, key) -> "torch.cuda.Stream | None":
        """The stream a batch of `key` = (layer id, op) runs on: a peer's (executor/peers.py), else None (the
        batcher's own)."""
        layer_id = key[0]
        if layer_id not in self._homes:
            peer = getattr(self.layers.get(layer_id.split(GROUP_SEPARATOR, 1)[0]), "peer", None)
            self._homes[layer_id] = None if peer is None else peer.home
        return self._homes[layer_id]

    def tensor(self, name: str) -> torch.Tensor | None:
        return self.local.tensor(name)

    def get(self, layer_id: str):
        if layer_id in self.layers:
            return self.layers[layer_id]
        if GROUP_SEPARATOR not in layer_id:
            return None
        ids = layer_id.split(GROUP_SEPARATOR)
        members = [self.remote.get(i) for i in ids]
        if all(m is None for m in members):
            return self.local.get(layer_id)
        if any(m is None for m in members):
            return None  # siblings on different devices are not a group (placement keeps a decoder layer whole)
        first = members[0]
        spec = BaseLayerSpec(layer_id, first.spec.kind, first.spec.in_features,
                             sum(m.spec.out_features for m in members), "", first.spec.bias_name and "")
        if (all(isinstance(m, SplitLayer) for m in members) and len(set(ids)) == len(ids) > 1
                and len({(i.rpartition(".")[0], m.spec.kind, m.spec.in_features) for i, m in zip(ids, members)}) == 1):
            return MemberLayers(spec, members)  # each member split over the ranks
        if all(isinstance(m, RemoteLayer) for m in members) and len({m.link.rank for m in members}) == 1:
            return RemoteLayer(spec, first.link, first.dtype, first.device)  # the shard checks it is a group
        peer = getattr(first, "peer", None)  # a GPU of this process (peers.py): its own groups
        if peer is not None and all(getattr(m, "peer", None) is peer for m in members):
            return first.group(layer_id)
        return None

    def stop(self) -> None:
        for link in self.links:
            if link.lost is None:
                try:
                    link.request("stop", "", None, torch.float32, torch.device("cpu"))
                except ExecutorUnavailable:
                    pass


def _init_group(rank: int, world_size: int, devices: list[torch.device], init_method: str, timeout_s: float) -> None:
    device = devices[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(devices), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


SPLITS = ("layers", "columns")


def _plan(specs: list[BaseLayerSpec], world_size: int, split: str):
    """(layer id -> rank of a whole layer, layer id -> its column runs) of `split` (`SPLITS`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    columns = split_columns(specs, world_size) if split == "columns" else {}
    whole = place([s for s in specs if s.layer_id not in columns], world_size)
    return whole, columns


def _own(specs: list[BaseLayerSpec], rank: int, whole: dict, columns: dict):
    """A rank's layers (whole, or its slice's spec) and its slices' (first column, width)."""
    mine, slices = [], {}
    for spec in specs:
        if whole.get(spec.layer_id) == rank:
            mine.append(spec)
        for r, first, width in columns.get(spec.layer_id, ()):
            if r == rank:
                mine.append(spec)
                slices[spec.layer_id] = (first, width)
    return mine, slices


def front(path, devices: list[str | torch.device], dtype=None, init_method: str = "env://",
          timeout_s: float = DEFAULT_TIMEOUT_S, split: str = "layers", **executor_options):
    """Rank 0's `Executor` (call it in the process torchrun or `launch_sharded` made rank 0). `split`: whole decoder
    layers per rank ("layers"), or every layer's output columns over all ranks ("columns")."""
    devices = [torch.device(d) for d in devices]
    checkpoint, layout, specs, dtype = read_base_plan(path, dtype)
    whole, columns = _plan(specs, len(devices), split)
    _init_group(0, len(devices), devices, init_method, timeout_s)
    mine, slices = _own(specs, 0, whole, columns)
    local = BaseWeights(layout, mine, devices[0], dtype, columns=slices)
    backend = _backend(devices)
    held = lambda rank: sum(r == rank for r in whole.values()) + sum(  # noqa: E731
        any(r == rank for r, _, _ in runs) for runs in columns.values())
    links = [_Link(rank, devices[0], backend, held(rank)) for rank in range(1, len(devices))]
    elsewhere = lambda rank, spec: RemoteLayer(spec, links[rank - 1], dtype, devices[0])  # noqa: E731
    return assemble_front(checkpoint, local, specs, whole, columns, split, elsewhere, links, devices[0], dtype,
                          **executor_options)


def assemble_front(checkpoint, local: BaseWeights, specs: list[BaseLayerSpec], whole: dict, columns: dict,
                   split: str, elsewhere, links: list[_Link], device: torch.device, dtype: torch.dtype,
                   **executor_options) -> Executor:
    """The front's `Executor` over its own layers (`local`) and the other ranks': `elsewhere(rank, spec)` is the
    layer (or, split by columns, the slice: `spec` says its width) that rank holds (a shard's `RemoteLayer`, or a
    GPU of this process's `PeerLayer`, executor/peers.py)."""
    by_id = {s.layer_id: s for s in specs}
    remote = {i: elsewhere(rank, by_id[i]) for i, rank in whole.items() if rank}
    for layer_id, runs in columns.items():
        parts = [(first, local.layers[layer_id] if rank == 0 else
                  elsewhere(rank, dataclasses.replace(by_id[layer_id], out_features=width)))
                 for rank, first, width in runs]
        remote[layer_id] = SplitLayer(by_id[layer_id], parts)
    weights = ShardedWeights(local, remote, links)
    placement = {**whole, **{i: -1 for i in columns}}  # -1: split over every rank
    executor = Executor(checkpoint, weights, checkpoint.fingerprint(), device, dtype, **executor_options)
    executor.placement, executor.split = placement, split
    return executor


def serve_shard(rank: int, path, devices: list[str | torch.device], dtype=None, init_method: str = "env://",
                timeout_s: float = DEFAULT_TIMEOUT_S, split: str = "layers") -> None:
    """A shard's life: read its layers (or its slices of them), answer the front's requests until it says stop
    (or is gone)."""
    devices = [torch.device(d) for d in devices]
    device = devices[rank]
    _, layout, specs, dtype = read_base_plan(path, dtype)
    mine, slices = _own(specs, rank, *_plan(specs, len(devices), split))
    weights = BaseWeights(layout, mine, device, dtype, columns=slices)
    _init_group(rank, len(devices), devices, init_method, timeout_s)
    wire = device if _backend(devices) == "nccl" else torch.device("cpu")
    try:
        while True:
            header = torch.empty(4, dtype=torch.int64, device=wire)
            dist.recv(header, 0)
            op_index, rows, cols, length = header.tolist()
            op = ALL_OPS[op_index]
            if op == "stop":
                return
            name = torch.empty(length, dtype=torch.uint8, device=wire)
            if length:
                dist.recv(name, 0)
            layer_id = bytes(name.cpu().tolist()).decode(errors="replace")
            x = None
            if op in OPS:
                x = torch.empty(rows, cols, dtype=dtype, device=wire)
                dist.recv(x, 0)
            _answer(weights, op, layer_id, x, device, wire)
    finally:
        dist.destroy_process_group()


def _answer(weights: BaseWeights, op: str, layer_id: str, x, device, wire) -> None:
    layer = weights.get(layer_id)
    try:
        if layer is None:
            raise UnknownLayer(f"this executor serves no base layer {layer_id[:300]!r}")
        with torch.no_grad():
            if op in OPS:
                x = x.to(device)
                out = layer.backward(x) if op == "backward" else layer.forward(x, op == "forward")
            elif op == "squared_norms":
                out = layer.squared_norms[None]
            elif op == "weight":
                out = layer.weight
            else:
                out = layer.bias[None]
        status, message = 0, b""
    except UnknownLayer as e:
        status, message = 2, str(e).encode()
    except Exception as e:  # noqa: BLE001 -- said to the front, which raises it to the caller; the shard keeps serving
        status, message = 1, f"{type(e).__name__}: {e}".encode()[:4000]
    rows, cols = out.shape if status == 0 else (0, 0)
    dist.send(torch.tensor([status, rows, cols, len(message)], dtype=torch.int64, device=wire), 0)
    if status:
        dist.send(torch.frombuffer(bytearray(message), dtype=torch.uint8).to(wire), 0)
    else:
        dist.send(out.to(wire).contiguous(), 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_sharded(path, devices: list[str | torch.device], dtype=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                   split: str = "layers", **executor_options):
    """Start one shard process per device after the first (this machine), and return the front here (rank 0).
    `executor.close()` stops the shards; `executor.shards` are their processes."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
    processes = []
    for rank in range(1, len(devices)):
        command = [sys.executable, "-m", "symbiosis.executor.sharded", "--model", str(Path(path)), "--rank", str(rank),
                   "--devices", ",".join(map(str, devices)), "--init-method", init_method, "--timeout", str(timeout_s),
                   "--split", split]
        if dtype_name:
            command += ["--dtype", dtype_name]
        processes.append(subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    try:
        executor = front(path, devices, dtype, init_method, timeout_s, split, **executor_options)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    executor.shards = processes
    close = executor.close

    def close_all() -> None:
        close()
        executor.weights.stop()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    executor.close = close_all
    return executor


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="one shard of a sharded symbiosis executor (launch_sharded starts it)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--devices", required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--dtype")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--split", choices=SPLITS, default="layers")
    args = parser.parse_args(argv)
    serve_shard(args.rank, args.model, args.devices.split(","), args.dtype, args.init_method, args.timeout, args.split)
    return 0


if __name__ == "__main__":
    sys.exit(main())
