"""The client's side of `ipc://` and `tcp://`: `symbiosis.connect(url, token=...)`.

    executor = symbiosis.connect("ipc:///tmp/symbiosis.sock", token=token)
    model = symbiosis.from_pretrained(path, executor, auto_class=AutoModelForCausalLM)

Requests are synchronous request/replies on a ZeroMQ DEALER socket, each with a timeout: an executor that
is gone or hung raises `ExecutorUnavailable` instead of hanging the client. On `ipc://` the layer calls
themselves take the doorbell path (`doorbell.py`), with the same timeout. A heartbeat thread (its own
socket) keeps the executor from reaping a client that is busy computing on its side.

A client on the executor's GPU makes its calls *pipelined*: a call queues its input copy, a flag write, a
stream wait for the executor's flag and the output copy on the client's stream, rings, and returns without
waiting for anything (`streamops.py`). The client's CPU runs ahead like a plain model's, and the round trip
leaves its critical path. The executor's answers are collected where a result could be used: at the end of
the model's forward and of each backward pass (`synchronize`), which raise the first error among them.
Calls are checked for shape and layer here, before they are queued, so that errors show at the call.
"""

from __future__ import annotations

import itertools
import os
import secrets
import select
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from urllib.parse import urlparse

import torch
import zmq

from symbiosis.errors import ExecutorUnavailable, SymbiosisError, Unauthorized, UnknownClient
from symbiosis.protocol import check_call
from symbiosis.model.partition import BaseLayerSpec, group_spec
from symbiosis.transport import auth, handoff, streamops, wire
from symbiosis.transport.base import Session
from symbiosis.transport.doorbell import CHECK_EVERY, Doorbell
from symbiosis.transport.shm import SharedBuffer

INITIAL_BUFFER_BYTES = 8 << 20
HANDSHAKE_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
# Devices on which a session of this process makes pipelined calls. Only one per device: sessions of one
# process share its CUDA stream, and the executor's stream may take their calls in another order than that
# stream queued them, so each could end up waiting for the other's. Later sessions wait for their answers.
_PIPELINED_DEVICES: set[int] = set()
_PIPELINED_LOCK = threading.Lock()
FLAG_BYTES = 8  # int32 [input seq (the client writes), output seq (the executor writes)]


class _Channel:
    """One DEALER socket with request/reply matching by id and a timeout on every request. It presents the
    client's token in ZeroMQ's handshake (`auth.py`); a handshake the executor refuses raises `Unauthorized`."""

    def __init__(self, url: str, timeout: float, token: str | None):
        self.url = url
        self.timeout = timeout
        self.token = token
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, secrets.token_bytes(12))
        auth.secure_client(self.socket, self.token)
        self._monitor = self.socket.get_monitor_socket(HANDSHAKE_REFUSED)
        self._poller = zmq.Poller()
        self._poller.register(self.socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.socket.connect(self.url)

    def close(self) -> None:
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=0)

    def send(self, header: dict, *tensors: torch.Tensor) -> None:
        with self._lock:
            wire.send(self.socket, wire.encode(header, *tensors))

    def request(self, header: dict, *tensors: torch.Tensor) -> tuple[dict, list]:
        with self._lock:
            header = {**header, "id": next(self._ids)}
            wire.send(self.socket, wire.encode(header, *tensors))
            deadline = time.monotonic() + self.timeout
            while (left := deadline - time.monotonic()) > 0:
                events = dict(self._poller.poll(int(left * 1000) + 1))
                if self._monitor in events:
                    self._monitor.recv_multipart()
                    raise Unauthorized("executor refused the client: missing or wrong token (ZeroMQ's handshake "
                                       "failed: an executor with tokens needs one, one without takes none)")
                if self.socket not in events:
                    continue
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
        self._description: dict | None = None

    def attach(self, fingerprint: str, name: str = "client", device: str | torch.device = "cpu") -> "RemoteSession":
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return RemoteSession(self, fingerprint, name, device)

    def _ask(self, op: str) -> dict:
        channel = _Channel(self.url, self.timeout, self.token)
        try:
            return channel.request({"op": op})[0]
        finally:
            channel.close()

    def stats(self) -> dict:
        return self._ask("stats")["stats"]

    def pipelines(self, device: torch.device) -> bool:
        """Whether a client on `device` makes pipelined calls: same-host, on the executor's GPU, and both
        processes can queue stream memory operations."""
        if not self.shared_buffers or device.type != "cuda":
            return False
        if self._description is None:
            self._description = self._ask("describe")
        return self._description["device"] == str(device) and self._description["stream_ops"] and \
            streamops.available(device)


class RemoteSession(Session):
    """A client's handle on a remote executor (`base.Session`)."""

    def __init__(self, executor: RemoteExecutor, fingerprint: str, name: str, device: torch.device):
        self.executor, self.fingerprint, self.name, self.device = executor, fingerprint, name, device
        self.channel = _Channel(executor.url, executor.timeout, executor.token)
        self.buffer: SharedBuffer | None = None
        self.doorbell: Doorbell | None = None
        self.link = None  # ipc://: the handoff connection (handoff.py): end-of-file when the executor is gone
        self.flags: SharedBuffer | None = None  # pipelined calls (see the module's docstring)
        self._retired_flags: list[SharedBuffer] = []  # released flags a stream may still wait on: kept alive
        self._broken: str | None = None  # why calls can no longer be made (the executor stopped answering)
        self._release_stream: int | None = None  # where _release writes the output flag
        # Set while this session is its process's pipelined one on its device; calling it (or collecting
        # the session) gives the device up.
        self._pipeline_claim: weakref.finalize | None = None
        self._call_lock = threading.Lock()  # one call at a time uses the buffer
        self._sync_queued = False  # a synchronize() is queued for the end of the running backward pass
        # Layer calls made, and seconds this client's thread spent waiting for their replies (the executor's
        # queue, compute and the transport): what the executor costs a client, read by the benchmarks.
        self.calls, self.waited_s = 0, 0.0
        self._heartbeat_stop = threading.Event()
        self._attach(INITIAL_BUFFER_BYTES)

    @property
    def pipelined(self) -> bool:
        return self.flags is not None

    def _attach(self, buffer_bytes: int) -> None:
        """Attach (ipc://: with shared memory the executor makes and hands over, `handoff.py`; a pipelined
        client's CUDA buffer and flags are its own, described to the executor by their IPC handles)."""
        shared = None
        if self.executor.shared_buffers:
            if self.executor.pipelines(self.device) and self._claim_pipeline():
                self.buffer = SharedBuffer.create_cuda(max(buffer_bytes, INITIAL_BUFFER_BYTES), self.device)
                self.flags = SharedBuffer.create_cuda(FLAG_BYTES, self.device)
                self.flags.tensor.zero_()
                self.flags.stream.synchronize()  # zeros before the executor's first wait reads them
                if self._release_stream is None:  # made now: making one once a stream is stuck can hang
                    self._release_stream = streamops.side_stream(self.device.index)
                shared = {"cuda": self.buffer.description, "flags": self.flags.description}
            else:
                shared = {"nbytes": max(buffer_bytes, INITIAL_BUFFER_BYTES)}
        reply, _ = self.channel.request({"op": "attach", "fingerprint": self.fingerprint, "name": self.name,
                                         "shared": shared})
        if shared is not None:
            host = "nbytes" in shared
            self.link, fds = handoff.claim(reply["handoff"], bytes.fromhex(reply["ticket"]), 4 if host else 3,
                                           self.executor.timeout)
            self.doorbell = Doorbell(*fds[:3])
            if host:
                self.buffer = SharedBuffer.from_fd(fds[3], int(reply["buffer_bytes"]))
                os.close(fds[3])
        self.client_id = reply["client"]
        self.dtype = wire.parse_dtype(reply["dtype"])
        self.executor_device = reply["device"]
        self.max_call_tokens = int(reply["max_call_tokens"])
        self.heartbeat_s = float(reply["heartbeat_s"])
        self.layer_specs = {d["layer_id"]: BaseLayerSpec(**d) for d in reply["layers"]}
        self._broken = None
        self._heartbeat_stop.clear()
        # The thread holds the session weakly: a session nobody holds any more is collected (its claim on
        # pipelining given up), its heartbeats stop, and the executor reaps it.
        threading.Thread(target=_heartbeat, args=(weakref.ref(self), self.client_id, self._heartbeat_stop),
                         name="symbiosis-heartbeat", daemon=True).start()

    def _claim_pipeline(self) -> bool:
        with _PIPELINED_LOCK:
            if self._pipeline_claim is None and self.device.index not in _PIPELINED_DEVICES:
                _PIPELINED_DEVICES.add(self.device.index)
                self._pipeline_claim = weakref.finalize(self, _PIPELINED_DEVICES.discard, self.device.index)
            return self._pipeline_claim is not None

    def _give_up_pipeline(self) -> None:
        """Let another session of this process pipeline on this device (this one is closed or broken)."""
        if self._pipeline_claim is not None:
            with _PIPELINED_LOCK:
                self._pipeline_claim()
            self._pipeline_claim = None

    def reconnect(self) -> None:
        """Attach again (after the executor restarted): a new client id; the model and its state are kept."""
        self._heartbeat_stop.set()  # the old heartbeat thread ends; _attach starts one for the new id
        self.channel.close()
        self.channel = _Channel(self.executor.url, self.executor.timeout, self.executor.token)
        old = (self.buffer, self.doorbell, self.link)
        if self.flags is not None:
            self._release("reconnecting")  # the old executor will never answer what it still owed
            self.flags = None
        self.buffer = self.doorbell = self.link = None
        self._attach(old[0].nbytes if old[0] is not None else 0)
        for shared in old:
            if shared is not None:
                shared.close()

    def _lost(self, why: str) -> None:
        """The executor is gone or stopped answering: calls raise from now on (a pipelined client's stream is
        let run past its waits)."""
        if self.pipelined:
            self._release(why)
        elif self._broken is None:
            self._broken = why

    def _release(self, why: str) -> None:
        """Mark the session broken, and let the client's stream run past every wait on the executor's flag
        (what it computes from there on is garbage, and the next call or synchronize() raises)."""
        if self._broken is not None:
            return
        self._broken = why
        flags = self.flags
        # On a stream of its own: the client's stream may be stuck waiting.
        streamops.release(self._release_stream, flags.tensor.data_ptr() + 4, self.doorbell.seq,
                          flags.tensor.device.index)
        self._retired_flags.append(flags)
        self._give_up_pipeline()  # reconnect() claims again

    def _request(self, header: dict, *tensors: torch.Tensor, channel: _Channel | None = None) -> tuple[dict, list]:
        self._check_open()
        try:
            return (channel or self.channel).request({**header, "client": self.client_id}, *tensors)
        except UnknownClient as e:
            raise ExecutorUnavailable(f"{e}. The executor at {self.executor.url} no longer knows this client; "
                                      "call reconnect() on the session to attach again") from e

    def _still_attached(self) -> None:
        """Raise if the executor answers that it does not know this client; no answer in time proves nothing."""
        probe = _Channel(self.executor.url, min(self.executor.timeout, CHECK_EVERY), self.executor.token)
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
        if self._broken is not None:
            raise ExecutorUnavailable(f"{self._broken}; results since its last answer are lost. "
                                      "Call reconnect() on the session once an executor serves again")

    def _ensure_capacity(self, nbytes: int) -> None:
        if nbytes <= self.buffer.nbytes:
            return
        old = self.buffer
        self._wait_answers()
        if old.stream is not None:
            old.stream.synchronize()  # nothing may still use the old one
        wanted = max(nbytes, old.nbytes * 3 // 2)
        if self.pipelined:  # our own CUDA memory, described to the executor
            new = SharedBuffer.create_cuda(wanted, old.tensor.device)
            try:
                self._request({"op": "buffer", "buffer": new.description})
            except BaseException:
                new.close()  # the executor still uses the old one
                raise
        else:  # made by the executor, handed over on the handoff connection before its reply
            reply, _ = self._request({"op": "buffer", "nbytes": wanted, "at_least": nbytes})
            (fd,) = handoff.receive(self.link, 1)
            new = SharedBuffer.from_fd(fd, int(reply["nbytes"]))
            os.close(fd)
        self.buffer = new
        old.close()

    def _wait_answers(self) -> None:
        """Until every call made is answered; a failure is reported as an earlier call's."""
        self.doorbell.wait_answered(self.doorbell.seq, self.executor.timeout, self._still_attached)
        self.doorbell.raise_error()

    @contextmanager
    def _releasing(self):
        """An executor that stops answering a pipelined client would leave its stream waiting for flags
        that never come: release it before the error goes up."""
        try:
            yield
        except ExecutorUnavailable as e:
            if self.pipelined:
                self._release(str(e))
            raise

    def synchronize(self, gpu: bool = False) -> None:
        """Wait until the executor has answered every call made so far, raising the first error among them
        (a no-op unless calls are pipelined). With `gpu`, also until the client's GPU has run them: an
        executor that died meanwhile then raises `ExecutorUnavailable` here instead of hanging."""
        if not self.pipelined:
            return
        with self._call_lock, self._releasing():
            self._check_open()
            self._wait_answers()
            if not gpu:
                return
            done = torch.cuda.Event()
            done.record(self.buffer.stream)
            deadline = time.monotonic() + self.executor.timeout
            while not done.query():
                if time.monotonic() > deadline:
                    self._release(f"the executor's results did not reach the GPU within {self.executor.timeout:g}s")
                    break
                time.sleep(50e-6)
            self._check_open()  # the heartbeat may have released the stream meanwhile: the results are lost

    def _end_of_backward(self) -> None:
        self._sync_queued = False
        self.synchronize(gpu=True)  # before the optimizer could apply gradients computed from lost results

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
        rows, cols = sent.shape  # [T, d_in]: _spec has checked it
        with self._call_lock, self._releasing():
            self._ensure_capacity(rows * max(cols, out_width) * self.dtype.itemsize)
            self.buffer.view(self.dtype, [rows, cols]).copy_(sent)
            started = time.perf_counter()
            if self.pipelined:
                stream, flags, device = self.buffer.stream.cuda_stream, self.flags.tensor.data_ptr(), self.device.index
                streamops.write(stream, flags, self.doorbell.seq + 1, device)  # the input is in the buffer
            seq = self.doorbell.submit(op, layer_id, inference, self.dtype, (rows, cols), self.executor.timeout,
                                       self._still_attached)
            if self.pipelined:
                streamops.wait_geq(stream, flags + 4, seq, device)  # the output is in the buffer
            else:
                self.doorbell.wait(seq, self.executor.timeout, self._still_attached)
            self.waited_s += time.perf_counter() - started
            # One copy out of the buffer (the next call reuses it), cast on the way if need be.
            return self.buffer.view(self.dtype, [rows, out_width]).to(tensor.device, tensor.dtype, copy=True)

    def _spec(self, layer_id: str, tensor: torch.Tensor, op: str) -> BaseLayerSpec:
        """The layer's spec, once the call is checked as the executor would (a pipelined call's error would
        otherwise show only at a later call)."""
        spec = group_spec(self.layer_specs, layer_id)
        check_call(layer_id, spec, op, tensor, self.max_call_tokens)
        return spec

    def forward(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        return self._call("forward", layer_id, x, self._spec(layer_id, x, "forward").out_features, inference)

    def forward_nobias(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        width = self._spec(layer_id, x, "forward_nobias").out_features
        return self._call("forward_nobias", layer_id, x, width, inference)

    def backward(self, layer_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        width = self._spec(layer_id, grad_out, "backward").in_features
        if self.pipelined and not self._sync_queued and torch._C._current_graph_task_id() != -1:
            self._sync_queued = True  # collect this pass's answers when autograd finishes it
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return self._call("backward", layer_id, grad_out, width, False)

    def _ask_tensors(self, op: str, layer_id: str) -> list[torch.Tensor]:
        reply, frames = self._request({"op": op, "layer": layer_id})
        return [wire.frame_tensor(f, spec).clone() for f, spec in zip(frames, reply["tensors"])]

    def fetch(self, layer_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        tensors = self._ask_tensors("fetch", layer_id)
        return tensors[0], (tensors[1] if len(tensors) > 1 else None)

    def weight_norms(self, layer_id: str) -> torch.Tensor:
        return self._ask_tensors("weight_norms", layer_id)[0]

    def close(self) -> None:
        if self._heartbeat_stop.is_set():
            return
        try:
            if self.pipelined and self._broken is None:
                try:
                    self.synchronize(gpu=True)  # the executor must not write into a freed buffer
                except SymbiosisError:
                    pass  # an earlier call's error, or an executor gone: closing regardless
            self._request({"op": "detach"})
        except ExecutorUnavailable:
            pass
        finally:
            self._heartbeat_stop.set()
            self.channel.close()
            for shared in (self.buffer, self.doorbell, self.link):
                if shared is not None:
                    shared.close()
            self._give_up_pipeline()


def _heartbeat(session_ref: weakref.ref, client_id: str, stop: threading.Event) -> None:
    """Keeps the executor from reaping a session while it exists. A pipelined session pings instead: an
    executor that stops answering would otherwise leave the client's stream waiting for a flag forever, and
    a CPU that synchronises with it (`loss.item()`) hanging; then the stream is released and the session
    marked broken, so its next call raises. On ipc:// the handoff connection reads as end-of-file as soon as
    the executor's process is gone: the session is marked broken at once, not after a timeout."""
    session = session_ref()
    channel = _Channel(session.executor.url, session.executor.timeout, session.executor.token)
    period, url, link = session.heartbeat_s, session.executor.url, session.link
    del session  # held only while it is used
    try:
        while True:
            gone = _link_gone(stop, link, period) if link is not None else False
            if link is None:
                stop.wait(period)
            if stop.is_set():
                return
            session = session_ref()
            if session is None or session.client_id != client_id:
                return  # collected, or attached again under a new id (with a heartbeat of its own)
            if gone:
                session._lost(f"the executor at {url} closed this client's connection (it stopped, or detached "
                              "this client)")
                return
            if not session.pipelined:
                channel.send({"op": "heartbeat", "client": client_id})
                del session
                continue
            try:
                channel.request({"op": "ping", "client": client_id})
            except SymbiosisError as e:
                if not stop.is_set():
                    session._lost(f"the executor at {url} stopped answering ({e})")
                return
            del session
    finally:
        channel.close()


def _link_gone(stop: threading.Event, link, period: float) -> bool:
    """Watch the handoff connection for `period` seconds (less once stopped): whether it reached its end."""
    deadline = time.monotonic() + period
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            if not select.select([link], [], [], min(0.2, period))[0]:
                continue
            if link.recv(1, socket.MSG_PEEK) == b"":  # readable: no wait; a handed-over buffer is not the end
                return True
        except (ValueError, OSError):  # the session closed it meanwhile
            return False
        time.sleep(0.01)  # a handed-over buffer, for the session's own thread to take
    return False


def connect(url: str, token: str | None = None, timeout: float = 60.0) -> RemoteExecutor:
    """An executor served at `url` (`ipc://PATH` on this host, `tcp://HOST:PORT` anywhere).

    `timeout`: seconds any one call may take before `ExecutorUnavailable` is raised.
    """
    return RemoteExecutor(url, token, timeout)
