"""The client's side of `ipc://` and `tcp://`: `symbiosis.connect(url, token=...)`.

    executor = symbiosis.connect("ipc:///tmp/symbiosis.sock", token=token)
    model = symbiosis.from_pretrained(path, executor, auto_class=AutoModelForCausalLM)

Requests are synchronous request/replies on a ZeroMQ DEALER socket, each with a timeout: an executor that
is gone or hung raises `ExecutorUnavailable` instead of hanging the client. On `ipc://` the layer calls
themselves take the doorbell path (`doorbell.py`), with the same timeout. A heartbeat thread (its own
socket) keeps the executor from reaping a client that is busy computing on its side.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from urllib.parse import urlparse

import torch
import zmq

from symbiosis.errors import ExecutorUnavailable, SymbiosisError, UnknownClient
from symbiosis.model.partition import BaseLayerSpec, group_spec
from symbiosis.transport import wire
from symbiosis.transport.doorbell import CHECK_EVERY, Doorbell
from symbiosis.transport.shm import SharedBuffer, open_ipc_event

INITIAL_BUFFER_BYTES = 8 << 20


class _Channel:
    """One DEALER socket with request/reply matching by id and a timeout on every request."""

    def __init__(self, url: str, timeout: float):
        self.url = url
        self.timeout = timeout
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, secrets.token_bytes(12))
        self.socket.connect(self.url)

    def close(self) -> None:
        self.socket.close(linger=0)

    def send(self, header: dict, *tensors: torch.Tensor) -> None:
        with self._lock:
            wire.send(self.socket, wire.encode(header, *tensors))

    def request(self, header: dict, *tensors: torch.Tensor) -> tuple[dict, list]:
        with self._lock:
            header = {**header, "id": next(self._ids)}
            wire.send(self.socket, wire.encode(header, *tensors))
            deadline_ms = int(self.timeout * 1000)
            while self.socket.poll(deadline_ms, zmq.POLLIN):
                frames = self.socket.recv_multipart(copy=False)
                reply = wire.decode_header(frames[0]) if frames else {}
                if reply.get("id") == header["id"]:
                    if not reply.get("ok"):
                        wire.raise_error(reply)
                    return reply, frames[1:]
                # a stale reply to an earlier, timed-out request: skip it
            # Nothing in time: drop the socket so queued requests are not replayed to a restarted executor.
            self.close()
            self._open()
        raise ExecutorUnavailable(f"executor at {self.url} did not answer {header['op']!r} within {self.timeout:g}s "
                                  "(stopped, restarted or overloaded)")


class RemoteExecutor:
    """An executor in another process or on another host; a drop-in for `Executor` in `from_pretrained`."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0):
        scheme = urlparse(url).scheme
        if scheme not in ("ipc", "tcp"):
            raise ValueError(f"unsupported executor URL {url!r}: use ipc://PATH or tcp://HOST:PORT")
        self.url, self.token, self.timeout = url, token, timeout
        self.shared_buffers = scheme == "ipc"

    def attach(self, fingerprint: str, name: str = "client", device: str | torch.device = "cpu") -> "RemoteSession":
        return RemoteSession(self, fingerprint, name, torch.device(device))

    def stats(self) -> dict:
        channel = _Channel(self.url, self.timeout)
        try:
            return channel.request({"op": "stats", "token": self.token})[0]["stats"]
        finally:
            channel.close()


class RemoteSession:
    """A client's handle on a remote executor: same interface as the in-process session."""

    supports_groups = True

    def __init__(self, executor: RemoteExecutor, fingerprint: str, name: str, device: torch.device):
        self.executor, self.fingerprint, self.name, self.device = executor, fingerprint, name, device
        self.channel = _Channel(executor.url, executor.timeout)
        self.buffer: SharedBuffer | None = None
        self.doorbell: Doorbell | None = None
        self._call_lock = threading.Lock()  # one call at a time uses the buffer
        # Layer calls made, and seconds this client's thread spent waiting for their replies (the executor's
        # queue, compute and the transport): what the executor costs a client, read by the benchmarks.
        self.calls, self.waited_s = 0, 0.0
        self._heartbeat_stop = threading.Event()
        self._attach(INITIAL_BUFFER_BYTES)

    def _attach(self, buffer_bytes: int) -> None:
        """Attach with a new shared buffer and doorbell (ipc://). Their files are unlinked as soon as the
        executor has opened them: both sides keep their mappings and FIFO descriptors, and nothing is left
        in /dev/shm whichever process dies first."""
        if self.executor.shared_buffers:
            self.buffer = SharedBuffer.create(buffer_bytes, self.device if self.device.type == "cuda"
                                              else torch.device("cpu"))
            self.doorbell = Doorbell.create()
        try:
            reply, _ = self.channel.request({
                "op": "attach", "token": self.executor.token, "fingerprint": self.fingerprint, "name": self.name,
                "buffer": self.buffer.description if self.buffer else None,
                "doorbell": self.doorbell.description if self.doorbell else None})
        finally:
            if self.buffer is not None:
                self.buffer.unlink()
                self.doorbell.unlink()
        self.client_id = reply["client"]
        self.dtype = wire.parse_dtype(reply["dtype"])
        self.executor_device = reply["device"]
        self.heartbeat_s = float(reply["heartbeat_s"])
        self.layer_specs = {d["layer_id"]: BaseLayerSpec(**d) for d in reply["layers"]}
        self._executor_done = None  # CUDA buffers: the executor's event, recorded once a result is written
        if reply.get("done_event"):
            self._executor_done = open_ipc_event(self.buffer.tensor.device, reply["done_event"])
        self._heartbeat_stop.clear()
        threading.Thread(target=self._heartbeat, args=(self.client_id,), name="symbiosis-heartbeat", daemon=True).start()

    def reconnect(self) -> None:
        """Attach again (after the executor restarted): a new client id; the model and its state are kept."""
        self._heartbeat_stop.set()  # the old heartbeat thread ends; _attach starts one for the new id
        self.channel.close()
        self.channel = _Channel(self.executor.url, self.executor.timeout)
        old_buffer, old_doorbell = self.buffer, self.doorbell
        self._attach(old_buffer.nbytes if old_buffer is not None else 0)
        if old_buffer is not None:
            old_buffer.close()
            old_doorbell.close()

    def _heartbeat(self, client_id: str) -> None:
        channel = _Channel(self.executor.url, self.executor.timeout)
        stop = self._heartbeat_stop
        try:
            while not stop.wait(self.heartbeat_s) and client_id == self.client_id:
                channel.send({"op": "heartbeat", "client": client_id})
        finally:
            channel.close()

    def _request(self, header: dict, *tensors: torch.Tensor, channel: _Channel | None = None) -> tuple[dict, list]:
        self._check_open()
        try:
            return (channel or self.channel).request({**header, "client": self.client_id}, *tensors)
        except UnknownClient as e:
            raise ExecutorUnavailable(f"{e}. The executor at {self.executor.url} no longer knows this client; "
                                      "call reconnect() on the session to attach again") from e

    def _still_attached(self) -> None:
        """Raise if the executor answers that it does not know this client; no answer in time proves nothing."""
        probe = _Channel(self.executor.url, min(self.executor.timeout, CHECK_EVERY))
        try:
            self._request({"op": "ping"}, channel=probe)
        except ExecutorUnavailable as e:
            if isinstance(e.__cause__, UnknownClient):
                raise
        finally:
            probe.close()

    def _check_open(self) -> None:
        if self._heartbeat_stop.is_set():
            raise SymbiosisError(f"this session is closed (client {self.client_id!r}); attach a new one")

    def _ensure_capacity(self, nbytes: int) -> None:
        if nbytes <= self.buffer.nbytes:
            return
        old = self.buffer
        if old.ready is not None:
            old.stream.synchronize()  # nothing may still use the old one
        new = SharedBuffer.create(max(nbytes, old.nbytes * 3 // 2), old.tensor.device)
        try:
            self._request({"op": "buffer", "buffer": new.description})
        except BaseException:
            new.close()  # the executor still uses the old one
            raise
        finally:
            new.unlink()
        self.buffer = new
        old.close()

    def _call(self, op: str, layer_id: str, tensor: torch.Tensor, out_width: int, inference: bool) -> torch.Tensor:
        # tensor: [T, d_in] in the client's dtype/device -> [T, d_out] likewise
        sent = tensor.detach().to(self.dtype)
        self.calls += 1
        if self.buffer is None:
            header = {"op": op, "layer": layer_id, "inference": inference, "tensor": wire.describe(sent)}
            started = time.perf_counter()
            reply, frames = self._request(header, sent.cpu())
            self.waited_s += time.perf_counter() - started
            return wire.frame_tensor(frames[0], reply["tensor"]).to(tensor.device, tensor.dtype, copy=True)
        self._check_open()
        with self._call_lock:
            self._ensure_capacity(sent.shape[0] * max(sent.shape[1], out_width) * self.dtype.itemsize)
            self.buffer.view(self.dtype, list(sent.shape)).copy_(sent)
            if self.buffer.ready is not None:
                self.buffer.ready.record(self.buffer.stream)  # the executor's stream waits on this: no CPU sync
            started = time.perf_counter()
            dtype, shape = self.doorbell.call(op, layer_id, inference, sent, self.executor.timeout,
                                              self._still_attached)
            self.waited_s += time.perf_counter() - started
            if self._executor_done is not None:
                self.buffer.stream.wait_event(self._executor_done)
            # One copy out of the buffer (the next call reuses it), cast on the way if need be.
            return self.buffer.view(dtype, shape).to(tensor.device, tensor.dtype, copy=True)

    def _spec(self, layer_id: str) -> BaseLayerSpec:
        spec = group_spec(self.layer_specs, layer_id)
        return spec or BaseLayerSpec(layer_id, "linear", 0, 0, "", None)  # the executor answers UnknownLayer

    def direct(self, layer_id: str, x: torch.Tensor) -> None:
        return None  # the weights are in another process

    def forward(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        return self._call("forward", layer_id, x, self._spec(layer_id).out_features, inference)

    def forward_nobias(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        return self._call("forward_nobias", layer_id, x, self._spec(layer_id).out_features, inference)

    def backward(self, layer_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        return self._call("backward", layer_id, grad_out, self._spec(layer_id).in_features, False)

    def fetch(self, layer_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        reply, frames = self._request({"op": "fetch", "layer": layer_id})
        tensors = [wire.frame_tensor(f, spec).clone() for f, spec in zip(frames, reply["tensors"])]
        return tensors[0], (tensors[1] if len(tensors) > 1 else None)

    def close(self) -> None:
        if self._heartbeat_stop.is_set():
            return
        try:
            self._request({"op": "detach"})
        except ExecutorUnavailable:
            pass
        finally:
            self._heartbeat_stop.set()
            self.channel.close()
            if self.buffer is not None:
                self.buffer.close()
                self.doorbell.close()


def connect(url: str, token: str | None = None, timeout: float = 60.0) -> RemoteExecutor:
    """An executor served at `url` (`ipc://PATH` on this host, `tcp://HOST:PORT` anywhere).

    `timeout`: seconds any one call may take before `ExecutorUnavailable` is raised.
    """
    return RemoteExecutor(url, token, timeout)
