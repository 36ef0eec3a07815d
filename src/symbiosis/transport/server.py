"""The executor as a service: a ZeroMQ ROUTER socket in front of an `Executor`.

One I/O thread owns the socket and the clients' doorbells (`ipc/doorbell.py`: on `ipc://`, layer calls come
through a shared control block and a pipe byte instead of the socket). Requests are decoded and submitted to
the executor's batcher; when a call's future resolves (on the batcher thread) it is queued here and the I/O
thread is woken through a pipe, so only the I/O thread ever touches the socket. A client that stops sending
anything (calls or heartbeats) for `client_timeout` seconds, or an ipc:// client whose process has exited
(its handoff connection reads as end-of-file, `ipc/handoff.py`), is detached: its queued calls are dropped,
its shared memory unmapped, and batching stops waiting for it. What is the ipc:// transport's lives in
`ipc/`: the memory made for a client (`provision.py`), its handoff (`handoff.Desk`) and the rules of the
executor's CUDA stream for pipelined clients (`streams.py`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import torch
import zmq

from symbiosis.errors import BadCall, ExecutorUnavailable, SymbiosisError
from symbiosis.executor.executor import Executor
from symbiosis.protocol import OPS
from symbiosis.transport import auth, wire
from symbiosis.transport.collective import DataPlanes, submit
from symbiosis.transport.ipc import handoff
from symbiosis.transport.clients import ClientTable
from symbiosis.transport.mailbox import Mailbox
from symbiosis.transport.ipc.calls import DoorbellCalls
from symbiosis.transport.ipc.doorbell import SPARE_CORES
from symbiosis.transport.ipc.provision import Provisioner
from symbiosis.transport.ipc.streams import StreamRules

log = logging.getLogger("symbiosis.executor")
# For this long after a doorbell call the I/O thread polls without sleeping (the next call comes soon).
HOT_S = 2e-3 if SPARE_CORES else 0.0
DRAIN_AT_ONCE = 64  # socket messages read before the loop turns to its other inputs


def _router(context: zmq.Context, url: str, authenticated: bool, max_message: int) -> zmq.Socket:
    """The service's socket. ZeroMQ checks, before a message is read, the token (in the handshake: a
    connection that does not authenticate within 5 s is closed) and then the message's size."""
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, max_message)
    router.setsockopt(zmq.HANDSHAKE_IVL, 5000)
    router.plain_server = authenticated
    router.bind(url)
    return router


class ExecutorServer:
    """`tenants`: who may attach (`auth.Tenants`, or one bare token: one tenant, `admin`; None: anyone, as `admin`).
    `max_attaches` in all and `max_attaches_per_tenant`: refused beyond them, before anything is made."""

    def __init__(self, executor: Executor, url: str, tenants: auth.Tenants | str | None = None,
                 client_timeout: float = 30.0, max_attaches: int = 256, max_attaches_per_tenant: int = 64):
        self.executor = executor
        self.client_timeout = client_timeout
        self.clients = ClientTable(executor, max_attaches, max_attaches_per_tenant)
        if isinstance(tenants, str):
            tenants = auth.Tenants({auth.ADMIN: tenants})
        # No call a client may make needs a larger shared buffer, or message.
        self.max_buffer_bytes = executor.max_call_tokens * executor.widest * 8
        self._context = zmq.Context()  # its own: its ZAP handler answers for this server's socket alone
        self._zap = auth.ZapHandler(self._context, tenants) if tenants is not None else None
        max_message = executor.max_call_tokens * executor.widest * executor.dtype.itemsize + (1 << 20)
        self._socket = _router(self._context, url, self._zap is not None, max_message)
        # The bound endpoint: `tcp://host:*` binds a free port, and this says which.
        self.url = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._finished = Mailbox()  # calls the batcher thread completed, for the I/O thread to answer
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._poller = zmq.Poller()
        self._doorbells: dict[int, str] = {}  # request pipe fd -> client id
        self._links: dict[int, str] = {}  # handoff connection fd -> client id
        self._streams = StreamRules(executor.device)  # pipelined clients (same GPU)
        self._calls = DoorbellCalls(self.clients, self._streams, lambda client, header, tensor, gate: self._submit(
            client.identity, header, tensor, gate))
        self._provision = Provisioner(executor.device, self.max_buffer_bytes, self._streams.available)
        # nccl:// (gloo://) clients: their tensors over a process group each; answers and drops from their threads
        self._planes = DataPlanes(executor, lambda identity, header: self._finished.post(
            lambda: self._reply(identity, header)), lambda client_id: self._finished.post(
            lambda: self._drop(client_id)), client_timeout)
        # ipc://: the socket files are this user's alone, and shared memory is handed over beside them.
        self._ipc_path = Path(urlparse(self.url).path) if self.url.startswith("ipc://") else None
        self._desk = handoff.Desk(self._ipc_path, self._poller) if self._ipc_path is not None else None

    # --- lifecycle -----------------------------------------------------------------------------------

    def use_tenants(self, tenants: "auth.Tenants") -> None:
        """New tenants and tokens for connections made from now on (attached clients keep theirs)."""
        if self._zap is None:
            raise ValueError("this executor was started without tenants; it cannot be given some")
        self._zap.use(tenants)

    def start(self) -> "ExecutorServer":
        self._thread = threading.Thread(target=self.serve_forever, name="symbiosis-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._finished.post()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def serve_forever(self) -> None:
        poller = self._poller
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._finished.fd, zmq.POLLIN)
        next_reap = last_call = time.monotonic()
        try:
            while not self._stopping.is_set():
                # Spinning (polling with timeout 0) while the batcher has work would keep the GIL from its
                # thread for up to the switch interval each time; then sleep in poll() instead.
                hot = time.monotonic() - last_call < HOT_S and not self.executor.batcher.busy
                # Calls held back by the stream's depth: watch the stream (a millisecond at most while the
                # batcher thread needs the GIL).
                held = bool(self._streams) and not hot
                spin = hot or (held and SPARE_CORES and not self.executor.batcher.busy)
                events = dict(poller.poll(timeout=0 if spin else (1 if held else 200)))
                started = time.perf_counter()
                retired = self._streams.run_passed()
                for fd in events:
                    if fd in (self._socket, self._finished.fd):
                        continue
                    if fd in self._doorbells:
                        last_call = time.monotonic()
                    self._on_readable(fd)
                if self._socket in events:
                    self._drain_requests()
                if self._finished.fd in events:
                    self._answer_finished()
                if events or retired:
                    self.executor.stats.add_busy("io", time.perf_counter() - started)
                if time.monotonic() >= next_reap:
                    self._reap()
                    next_reap = time.monotonic() + min(1.0, self.client_timeout / 4)
        finally:
            for client_id in list(self.clients):
                self._drop(client_id)
            self._socket.close(linger=0)
            if self._desk is not None:
                self._desk.close()
                self._ipc_path.unlink(missing_ok=True)  # ZeroMQ leaves its socket file behind
            self._finished.close()
            if self._zap is not None:
                self._zap.close()
            self._context.term()

    def _on_readable(self, fd: int) -> None:
        """A doorbell, a handoff connection or the handoff socket. A failure handling one client's input
        detaches that client, never the service."""
        owner = self._doorbells.get(fd) or self._links.get(fd)
        try:
            if fd in self._doorbells:
                if not self._calls.take(owner):
                    log.warning("client %s closed its doorbell without detaching: detaching it", owner)
                    self._drop(owner)
            elif fd in self._links:
                if handoff.peer_gone(self.clients[owner].link):
                    log.warning("client %s exited without detaching: detaching it", owner)
                    self._drop(owner)
            elif self._desk is not None and self._desk.owns(fd):
                claimed = self._desk.on_readable(fd, lambda client_id: client_id in self.clients)
                if claimed is not None:
                    self._start_calls(*claimed)
        except Exception as error:
            if isinstance(error, SymbiosisError):  # the client broke the protocol: said why, no traceback
                log.warning("client %s: %s: detaching it", owner or "on a handoff connection", error)
            else:
                log.exception("handling %s failed: detaching it", owner or "a handoff connection")
            if owner is not None:
                self._drop(owner)

    def _start_calls(self, client_id: str, link: socket.socket) -> None:
        """A client holds its shared memory now: its doorbell calls begin, its link watches its process."""
        client = self.clients[client_id]
        client.link = link
        self._links[link.fileno()] = client_id
        self._poller.register(link.fileno(), zmq.POLLIN)  # readable again only when the client is gone
        self._doorbells[client.doorbell.request_fd] = client_id
        self._poller.register(client.doorbell.request_fd, zmq.POLLIN)

    # --- requests ------------------------------------------------------------------------------------

    def _drain_requests(self) -> None:
        """Up to DRAIN_AT_ONCE messages: a tenant flooding the socket must not keep the loop from the doorbells,
        finished calls and the reaper (the socket stays readable; the next poll comes back at once)."""
        for _ in range(DRAIN_AT_ONCE):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, payload = frames[0].bytes, frames[1:]
            # The tenant ZeroMQ's handshake authenticated this connection as (auth.py); no tokens: one tenant.
            tenant = frames[0].get("User-Id") if self._zap is not None else auth.ADMIN
            header = {}
            try:
                if not payload:
                    raise BadCall("malformed message: no header frame")
                header = wire.decode_header(payload[0])
                self._handle(identity, tenant, header, payload[1:])
            except Exception as error:  # any bad request is answered, never fatal
                if not isinstance(error, SymbiosisError):
                    log.exception("request %s failed", header.get("op"))
                self._reply(identity, wire.error_reply(header.get("id"), error))

    def _handle(self, identity: bytes, tenant: str, header: dict, frames: list) -> None:
        op = header.get("op")
        if op == "attach":
            return self._attach(identity, tenant, header)
        if op == "stats":  # the admin sees every tenant's figures; a tenant its own
            own = None if tenant == auth.ADMIN else self.clients.of_tenant(tenant)
            return self._reply(identity, {"id": header.get("id"), "ok": True,
                                          "stats": self.executor.stats_snapshot(only=own)})
        if op == "describe":  # what a client needs to know before it attaches
            return self._reply(identity, {"id": header.get("id"), "ok": True, "device": str(self.executor.device),
                                          "stream_ops": self._streams.available})
        client_id = header.get("client")
        client = self.clients.owned(client_id, tenant, identity, op)
        client.last_seen = time.monotonic()
        if op == "heartbeat":
            return None
        if op == "ping":
            return self._reply(identity, {"id": header.get("id"), "ok": True})
        if op == "store":  # the client's rank of its nccl:// pair meeting ours (rendezvous.py)
            return self._reply(identity, {"id": header.get("id"), "ok": True,
                                          **self._planes.rendezvous(client_id, header)})
        if op in OPS and header.get("collective"):  # the tensor comes over the client's process group
            return self._planes.call(identity, header, self.executor.max_call_tokens)
        if op in OPS:
            if len(frames) != 1:
                raise BadCall(f"{op} call carries {len(frames)} tensor frames, expected 1")
            return self._submit(identity, header, wire.frame_tensor(frames[0], header.get("tensor") or {}))
        if op in ("fetch", "weight_norms"):  # public facts about a base layer: its weight and bias, or its norms
            layer_id = str(header.get("layer"))
            found = self.executor.fetch(client_id, layer_id) if op == "fetch" else \
                (self.executor.weight_norms(client_id, layer_id),)
            tensors = [t.cpu() for t in found if t is not None]
            return self._reply(identity, {"id": header.get("id"), "ok": True,
                                          "tensors": [wire.describe(t) for t in tensors]}, *tensors)
        if op == "buffer":  # a larger shared buffer
            try:
                nbytes = self._provision.grow(client, header)
            except ExecutorUnavailable:  # it does not read its handoff connection: it would block this thread
                self._drop(client_id)
                raise
            return self._reply(identity, {"id": header.get("id"), "ok": True, "nbytes": nbytes})
        if op == "detach":
            self._drop(client_id)
            return self._reply(identity, {"id": header.get("id"), "ok": True})
        raise BadCall(f"unknown op {op!r}")

    def _attach(self, identity: bytes, tenant: str, header: dict) -> None:
        self.clients.check_room(tenant, header)
        if header.get("shared") is not None and self._desk is None:
            raise BadCall("shared buffers are for clients on this host: this executor serves tcp://")
        shared = self._provision.attach(header["shared"]) if header.get("shared") is not None else None
        client_id = self.clients.admit(identity, tenant, header, shared, time.monotonic())  # or all is closed
        try:
            plane = self._planes.admit(client_id, header["collective"]) if header.get("collective") else None
        except Exception:
            self._drop(client_id)
            if shared is not None:
                handoff.close_all(shared[3])  # the client's ends, never handed over
            raise
        buffer, _, flags, fds = shared if shared is not None else (None, None, None, [])
        # Calls begin once the client has claimed its descriptors (_start_calls).
        ticket = self._desk.issue(client_id, fds) if shared is not None else None
        log.info("attached %s (%s)", client_id, f"{buffer.description['kind']} shared buffer" if buffer else "frames")
        if flags is not None:
            self.clients.warn_without_mps()
        self._reply(identity, {
            "id": header.get("id"), "ok": True, "client": client_id, "fingerprint": self.executor.fingerprint,
            "dtype": wire.dtype_name(self.executor.dtype), "device": str(self.executor.device),
            "heartbeat_s": self.client_timeout / 4, "max_call_tokens": self.executor.max_call_tokens,
            "layers": [asdict(spec) for spec in self.executor.layer_specs.values()],
            "blocks": [asdict(spec) for spec in self.executor.block_specs.values()],
            "handoff": str(self._desk.path) if ticket else None, "ticket": ticket.hex() if ticket else None,
            "buffer_bytes": buffer.nbytes if buffer is not None else 0, "collective": plane,
            "experts": {group_id: group.num_experts for group_id, group in self.executor.weights.experts.items()},
        })

    def _submit(self, identity: bytes, header: dict, tensor: torch.Tensor,
                gate: Callable[[], None] | None = None) -> None:
        """A layer call, from a socket frame (tcp://) or a doorbell (ipc://, `header` has its "seq")."""
        # inline: a call the policy runs at once is computed on this thread, and answered straight away.
        future = submit(self.executor, header["client"], header, tensor, inline=True, gate=gate)
        if future.done():
            self._finish(identity, header, future)
        else:
            future.add_done_callback(lambda done: self._finished.post((identity, header, done)))

    # --- completions ---------------------------------------------------------------------------------

    def _answer_finished(self) -> None:
        for item in self._finished.take():
            if callable(item):  # a reply or a drop from a data-plane thread
                item()
                continue
            identity, header, future = item
            self._finish(identity, header, future)
            if "seq" in header:
                self._calls.pump(header["client"])

    def _finish(self, identity: bytes, header: dict, future: Future) -> None:
        if "seq" in header:  # a doorbell call: the result goes into the shared buffer
            return self._calls.finish(header["client"], header["seq"], future)
        if header["client"] not in self.clients:
            return  # the client left (or died) while its call ran: nobody to answer
        try:  # a socket call: the result goes back as a frame
            result = future.result()
            self._reply(identity, {"id": header.get("id"), "ok": True, "tensor": wire.describe(result)}, result.cpu())
        except Exception as error:
            self._reply(identity, wire.error_reply(header.get("id"), error))

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
                self._drop(client_id)
        for client_id in self._desk.expired() if self._desk is not None else ():
            log.warning("client %s did not claim its shared memory: detaching it", client_id)  # died attaching?
            self._drop(client_id)

    def _drop(self, client_id: str) -> None:
        client = self.clients.pop(client_id, None)
        self.executor.detach(client_id)
        self._planes.forget(client_id)
        if self._desk is not None:
            self._desk.forget(client_id)  # never handed over: the client's ends go too
        if client is None:
            return
        if client.flags is not None:
            self._streams.let_pass(client)
        elif client.buffer is not None:
            client.buffer.close()
        if client.doorbell is not None:
            if self._doorbells.pop(client.doorbell.request_fd, None) is not None:
                self._poller.unregister(client.doorbell.request_fd)
            client.doorbell.close()  # (the executor's stream never reads the control block)
        if client.link is not None:
            self._links.pop(client.link.fileno(), None)
            self._poller.unregister(client.link.fileno())
            client.link.close()
        log.info("detached %s", client_id)
