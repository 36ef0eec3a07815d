"""The executor as a service: a ZeroMQ ROUTER socket in front of an `Executor`.

One I/O thread owns the socket and the clients' doorbells (`doorbell.py`: on `ipc://`, layer calls come
through a shared control block and a FIFO byte instead of the socket). Requests are decoded and submitted to the executor's batcher; when a
call's future resolves (on the batcher thread) it is queued here and the I/O thread is woken through a
pipe, so only the I/O thread ever touches the socket. A client that stops sending anything (calls or
heartbeats) for `client_timeout` seconds is detached: its queued calls are dropped, its shared buffer
unmapped and removed, and batching stops waiting for it.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import torch
import zmq

from symbiosis.errors import BadCall, SymbiosisError, UnknownClient, Unauthorized
from symbiosis.executor.executor import Executor
from symbiosis.transport import wire
from symbiosis.transport.doorbell import SPARE_CORES, Doorbell
from symbiosis.transport.shm import SharedBuffer, ipc_event

log = logging.getLogger("symbiosis.executor")
# For this long after a doorbell call the I/O thread polls without sleeping (the next call comes soon).
HOT_S = 2e-3 if SPARE_CORES else 0.0
CALL_OPS = ("forward", "forward_nobias", "backward")


@dataclass
class RemoteClient:
    identity: bytes
    name: str
    buffer: SharedBuffer | None
    last_seen: float
    done: torch.cuda.Event | None = None  # CUDA buffers: recorded here once a result is in the buffer
    doorbell: Doorbell | None = None  # ipc://: the call path that bypasses the socket


class ExecutorServer:
    def __init__(self, executor: Executor, url: str, token: str | None = None, client_timeout: float = 30.0):
        self.executor = executor
        self.url = url
        self.token = token
        self.client_timeout = client_timeout
        self.clients: dict[str, RemoteClient] = {}
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(url)
        # The bound endpoint: `tcp://host:*` binds a free port, and this says which.
        self.url = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._completions: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._poller = zmq.Poller()
        self._doorbells: dict[int, str] = {}  # request FIFO fd -> client id

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> "ExecutorServer":
        self._thread = threading.Thread(target=self.serve_forever, name="symbiosis-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        os.write(self._wake_write, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def serve_forever(self) -> None:
        poller = self._poller
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        next_reap = last_call = time.monotonic()
        try:
            while not self._stopping.is_set():
                # Spinning (polling with timeout 0) while the batcher has work would keep the GIL from its
                # thread for up to the switch interval each time; then sleep in poll() instead.
                hot = time.monotonic() - last_call < HOT_S and not self.executor.batcher.busy
                events = dict(poller.poll(timeout=0 if hot else 200))
                started = time.perf_counter()
                for fd in events:
                    if fd in self._doorbells:
                        self._take_doorbell_call(self._doorbells[fd])
                        last_call = time.monotonic()
                if self._socket in events:
                    self._drain_requests()
                if self._wake_read in events:
                    self._drain_completions()
                if events:
                    self.executor.stats.add_busy("io", time.perf_counter() - started)
                if time.monotonic() >= next_reap:
                    self._reap()
                    next_reap = time.monotonic() + min(1.0, self.client_timeout / 4)
        finally:
            for client_id in list(self.clients):
                self._drop(client_id, unlink=False)
            self._socket.close(linger=0)
            os.close(self._wake_read)
            os.close(self._wake_write)

    # --- requests ------------------------------------------------------------------------------------

    def _drain_requests(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, payload = frames[0].bytes, frames[1:]
            header = {}
            try:
                if not payload:
                    raise BadCall("malformed message: no header frame")
                header = wire.decode_header(payload[0])
                self._handle(identity, header, payload[1:])
            except Exception as error:  # any bad request is answered, never fatal
                if not isinstance(error, SymbiosisError):
                    log.exception("request %s failed", header.get("op"))
                self._reply(identity, wire.error_reply(header.get("id"), error))

    def _handle(self, identity: bytes, header: dict, frames: list) -> None:
        op = header.get("op")
        if op == "attach":
            return self._attach(identity, header)
        if op == "stats":
            self._authorize(header)
            return self._reply(identity, {"id": header.get("id"), "ok": True,
                                          "stats": self.executor.stats_snapshot()})
        client_id = header.get("client")
        client = self.clients.get(client_id)
        # Heartbeats and pings come from the client's side sockets; everything else from its call socket.
        if client is None or (client.identity != identity and op not in ("heartbeat", "ping")):
            raise UnknownClient(f"client {client_id!r} is not attached to this executor (restarted, or timed out "
                                "without heartbeats); attach again")
        client.last_seen = time.monotonic()
        if op == "heartbeat":
            return None
        if op == "ping":
            return self._reply(identity, {"id": header.get("id"), "ok": True})
        if op in CALL_OPS:
            if len(frames) != 1:
                raise BadCall(f"{op} call carries {len(frames)} tensor frames, expected 1")
            return self._submit(identity, header, wire.frame_tensor(frames[0], header.get("tensor") or {}))
        if op == "fetch":
            weight, bias = self.executor.fetch(client_id, str(header.get("layer")))
            tensors = [weight.cpu()] + ([bias.cpu()] if bias is not None else [])
            return self._reply(identity, {"id": header.get("id"), "ok": True,
                                          "tensors": [wire.describe(t) for t in tensors]}, *tensors)
        if op == "buffer":
            new = self._open_buffer(header.get("buffer") or {})
            if new.tensor.is_cuda and client.done is None:
                raise BadCall("a client attached with a host buffer cannot switch to a CUDA buffer")
            if client.buffer is not None:
                client.buffer.close()
            client.buffer = new
            return self._reply(identity, {"id": header.get("id"), "ok": True})
        if op == "detach":
            self._drop(client_id, unlink=False)
            return self._reply(identity, {"id": header.get("id"), "ok": True})
        raise BadCall(f"unknown op {op!r}")

    def _authorize(self, header: dict) -> None:
        if self.token is None:
            return
        given = header.get("token")
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self.token.encode()):
            raise Unauthorized("executor refused the client: missing or wrong token")

    def _open_buffer(self, description: dict) -> SharedBuffer:
        buffer = SharedBuffer.open(description)
        if self.executor.device.type == "cuda":
            buffer.pin()  # a host buffer of a CPU client: DMA to and from the GPU
        return buffer

    def _attach(self, identity: bytes, header: dict) -> None:
        self._authorize(header)
        name = str(header.get("name", "client"))[:64]
        buffer = doorbell = None
        try:  # a refused attach leaves nothing mapped or open
            buffer = self._open_buffer(header["buffer"]) if header.get("buffer") else None
            doorbell = Doorbell.open(header["doorbell"]) if buffer is not None and header.get("doorbell") else None
            client_id = self.executor.register(str(header.get("fingerprint")), f"{name}-{secrets.token_hex(4)}")
        except Exception:
            for opened in (buffer, doorbell):
                if opened is not None:
                    opened.close()
            raise
        done, done_handle = ipc_event() if buffer is not None and buffer.tensor.is_cuda else (None, None)
        self.clients[client_id] = RemoteClient(identity, name, buffer, time.monotonic(), done, doorbell)
        if doorbell is not None:
            self._doorbells[doorbell.request_fd] = client_id
            self._poller.register(doorbell.request_fd, zmq.POLLIN)
        log.info("attached %s (%s)", client_id, f"{buffer.description['kind']} shared buffer" if buffer else "frames")
        self._reply(identity, {
            "done_event": done_handle,
            "id": header.get("id"), "ok": True, "client": client_id, "fingerprint": self.executor.fingerprint,
            "dtype": wire.dtype_name(self.executor.dtype), "device": str(self.executor.device),
            "heartbeat_s": self.client_timeout / 4, "max_call_tokens": self.executor.max_call_tokens,
            "layers": [asdict(spec) for spec in self.executor.layer_specs.values()],
        })

    def _submit(self, identity: bytes, header: dict, tensor: torch.Tensor) -> None:
        """A layer call, from a socket frame (tcp://) or a doorbell (ipc://, `header` has its "seq")."""
        # inline: a call the policy runs at once is computed on this thread, and answered straight away.
        future = self.executor.submit(header["client"], header["op"], str(header.get("layer")), tensor,
                                      inference=bool(header.get("inference")), inline=True)
        if future.done():
            self._finish(identity, header, future)
        else:
            future.add_done_callback(lambda f: self._complete(identity, header, f))

    def _take_doorbell_call(self, client_id: str) -> None:
        client = self.clients[client_id]
        seq = None
        try:
            request = client.doorbell.take_request()
            if request is None:
                return
            seq = request.seq
            client.last_seen = time.monotonic()
            tensor = client.buffer.view(request.dtype, request.shape)
            if client.buffer.ready is not None:  # the client's copy into the buffer comes first, on the GPU
                client.buffer.stream.wait_event(client.buffer.ready)
            header = {"op": request.op, "layer": request.layer, "inference": request.inference,
                      "client": client_id, "seq": seq}
            self._submit(client.identity, header, tensor)
        except Exception as error:
            if not isinstance(error, SymbiosisError):
                log.exception("doorbell call of %s failed", client_id)
            client.doorbell.answer(seq or client.doorbell.seq, wire.error_reply(None, error))

    # --- completions ---------------------------------------------------------------------------------

    def _complete(self, identity: bytes, header: dict, future: Future) -> None:
        self._completions.put((identity, header, future))
        os.write(self._wake_write, b"x")

    def _drain_completions(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                identity, header, future = self._completions.get_nowait()
            except queue.Empty:
                return
            self._finish(identity, header, future)

    def _finish(self, identity: bytes, header: dict, future: Future) -> None:
        client = self.clients.get(header["client"])
        if client is None:
            return  # the client left (or died) while its call ran: nobody to answer
        doorbell = "seq" in header  # else a socket call: the result goes back as a frame
        try:
            result = future.result()
            reply = {"id": header.get("id"), "ok": True, "tensor": wire.describe(result)}
            if doorbell:
                client.buffer.view(result.dtype, list(result.shape)).copy_(result)
                if client.done is not None:
                    client.done.record(client.buffer.stream)  # the client's stream waits on this
                return client.doorbell.answer(header["seq"], reply)
            self._reply(identity, reply, result.cpu())
        except Exception as error:
            reply = wire.error_reply(header.get("id"), error)
            if doorbell:
                return client.doorbell.answer(header["seq"], reply)
            self._reply(identity, reply)

    def _reply(self, identity: bytes, header: dict, *tensors: torch.Tensor) -> None:
        try:
            wire.send(self._socket, [identity, *wire.encode(header, *tensors)])
        except zmq.ZMQError as e:
            log.warning("could not answer %r: %s", identity, e)

    # --- departures ----------------------------------------------------------------------------------

    def _reap(self) -> None:
        now = time.monotonic()
        for client_id, client in list(self.clients.items()):
            if now - client.last_seen > self.client_timeout:
                log.warning("client %s silent for %.1fs: detaching it", client_id, now - client.last_seen)
                self._drop(client_id, unlink=True)

    def _drop(self, client_id: str, unlink: bool) -> None:
        client = self.clients.pop(client_id, None)
        self.executor.detach(client_id)
        if client is None:
            return
        if client.buffer is not None:
            client.buffer.close(unlink=unlink)
        if client.doorbell is not None:
            self._doorbells.pop(client.doorbell.request_fd, None)
            self._poller.unregister(client.doorbell.request_fd)
            client.doorbell.close(unlink=unlink)
