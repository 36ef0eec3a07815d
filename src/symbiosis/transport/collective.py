"""The `nccl://` transport: a client on another GPU (or host) whose activations travel over torch.distributed
point-to-point, NCCL between GPUs (no copy through host memory), gloo where a side computes on the CPU (the
tests' `gloo://`). Requests, replies and errors go over the executor's ZeroMQ socket as for `tcp://`
(`nccl://host:port` is the executor's `tcp://host:port`); only the tensors take the data plane.

At attach the executor hosts a TCPStore (once, on a free port it names in the reply) and each such client gets
a process group of its own, two ranks (the executor 0, the client 1), made from that store under the client's
id: clients come and go without a world-wide group. Per call, in this order on both sides:

    client:   post send(x)  ->  request {op, layer, rows, cols} and wait for the reply  ->  recv(y) if it says ok
    executor: recv(x) (the client's own worker thread)  ->  the executor computes  ->  reply, then post send(y)

Like `tcp://`'s messages (auth.py), the tensors travel unencrypted (NCCL's always do): on a network you do not
trust, carry both inside a tunnel. The executor receives a call's input only once its
header arrived and was checked (rows, width, dtype), on the
client's own thread, with the session timeout: a client that never sends its tensor stalls only itself, and is
detached. A reply with an error means nothing follows on the data plane, so both sides stay in step.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import queue
import secrets
import socket
import threading
import time
import weakref
from typing import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from symbiosis.errors import BadCall, ExecutorUnavailable
from symbiosis.protocol import check_call
from symbiosis.transport import wire
from symbiosis.transport.remote import RemoteSession

log = logging.getLogger("symbiosis")
_HOLDERS: "weakref.WeakSet" = weakref.WeakSet()  # sessions and planes holding a process group


@atexit.register
def _release_groups() -> None:
    """Process groups left to the interpreter's teardown abort the process (their C++ threads are destroyed
    while joinable): release them first. (Nothing else: a process that never made one is left alone; a garbage
    collection here made other processes' teardown abort now and then.)"""
    for holder in list(_HOLDERS):
        holder.group = None
SCHEMES = {"nccl": "nccl", "gloo": "gloo"}  # URL scheme -> backend of the data plane


def control_url(url: str) -> str:
    """The executor's ZeroMQ endpoint behind a data-plane URL: nccl://host:port -> tcp://host:port."""
    parsed = urlparse(url)
    return f"tcp://{parsed.netloc}"


def _group(backend: str, host: str, port: int, prefix: str, rank: int, timeout_s: float, device: torch.device,
           store=None):
    """This side's two-rank process group for one client (blocks until the other side joins)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = store or dist.TCPStore(host, port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        # A pair's operation that outlives the timeout (a client that never sent, or never received) must abort that
        # pair's communicator only: NCCL's watchdog otherwise tears the whole process down (its default, 3), every
        # other tenant with it. The setting is read when a group is made: ours get 2 (abort the communicator, raise
        # in its waits), other groups of this process keep what their owner chose.
        chosen = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        finally:
            if chosen is None:
                del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = chosen
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    # NCCL makes a pair's communicator at the pair's first send or recv, and connects each direction at the first
    # message that goes that way: both block the calling thread until the other rank does the same. No call may
    # be first: a client posts its send before its request goes out, and the executor posts the matching recv only
    # once the request came (each would wait for the other for ever); likewise the executor's first send and the
    # client's recv, which waits for the reply. Both sides wait for each other here anyway (attach): a one-element
    # message each way makes the communicator and both directions' connections here.
    token = torch.zeros(1, device=device if backend == "nccl" else "cpu")
    peer = 1 - rank
    for sender in (1, 0):
        (group.send([token], peer, 0) if rank == sender else group.recv([token], peer, 0)).wait(timeout)
    return group


def _arrived(work, backend: str, timeout: datetime.timedelta, what: str) -> None:
    """Block this thread until `work` (a receive) completed, at most `timeout`, and order the current stream after
    it. NCCL's own `wait(timeout)` looks only once a millisecond (a sleep between looks), which was most of a remote
    call's time, and its stream wait comes before its host wait, so a receive that never completes would hold the
    stream, and everyone's batches behind it: here the stream waits only for data that is there. (gloo's wait is
    woken by the data itself; its works complete only inside `wait`.)"""
    if backend != "nccl":
        work.wait(timeout)
        return
    deadline, pause = time.monotonic() + timeout.total_seconds(), _FIRST_LOOK_S
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not arrive within {timeout.total_seconds():g} s")
        time.sleep(pause)
        pause = min(2 * pause, _LAST_LOOK_S)
    work.wait()


# Looks at a pending receive back off from 10 us to 0.5 ms: a client's GPU usually reaches its send within a
# fraction of a millisecond of its request, and every look takes the executor's GIL from its batcher.
_FIRST_LOOK_S, _LAST_LOOK_S = 1e-5, 5e-4


class CollectiveSession(RemoteSession):
    """A client's session over `nccl://` (or `gloo://`): control over ZeroMQ, tensors over its process group."""

    def __init__(self, executor, fingerprint: str, name: str, device: torch.device):
        self.backend = executor.data_plane
        if self.backend == "nccl" and device.type != "cuda":
            raise ValueError("nccl:// carries GPU tensors: attach the client on a CUDA device (gloo:// for the CPU)")
        self.group = None
        super().__init__(executor, fingerprint, name, device)

    def _attach_request(self) -> dict:
        return {"collective": {"backend": self.backend}}

    def _take_shared(self, reply: dict) -> None:
        plane = reply.get("collective")
        if not plane:
            raise ExecutorUnavailable("the executor did not open a data plane for this nccl:// client")
        host = urlparse(self.executor.url).hostname
        try:
            self.group = _group(self.backend, host, int(plane["port"]), plane["prefix"], 1, self.executor.timeout,
                                self.device)
        except (RuntimeError, ValueError) as e:  # the store or the executor's rank never answered in time
            raise ExecutorUnavailable(f"the {self.backend}:// data plane could not be set up with the executor at "
                                      f"{host}:{plane['port']}: {str(e).splitlines()[0] if str(e) else e!r}") from e
        _HOLDERS.add(self)
        self.wire_device = self.device if self.backend == "nccl" else torch.device("cpu")

    grouped_experts = True

    def _call(self, op: str, layer_id: str, tensor: torch.Tensor, out_width: int, inference: bool,
              counts: list[int] | None = None) -> torch.Tensor:
        sent = tensor.detach().to(self.wire_device, self.dtype).contiguous()
        self.calls += 1
        header = {"op": op, "layer": layer_id, "inference": inference, "collective": True,
                  "rows": sent.shape[0], "cols": sent.shape[1], "dtype": wire.dtype_name(self.dtype)}
        if counts is not None:  # a MoE projection's experts: `layer_id` names them, `counts` their rows
            header["counts"] = counts
        started = time.perf_counter()
        sending = self.group.send([sent], 0, 0)
        log.debug("client %s: %s %s: input posted, requesting", self.client_id, op, layer_id)
        self._request(header)  # raises the executor's error: then nothing else comes on the data plane
        log.debug("client %s: %s %s: answered, receiving", self.client_id, op, layer_id)
        sending.wait()
        result = torch.empty(sent.shape[0], out_width, dtype=self.dtype, device=self.wire_device)
        self.group.recv([result], 0, 0).wait()
        self.waited_s += time.perf_counter() - started
        return result.to(tensor.device, tensor.dtype)

    def close(self) -> None:
        super().close()
        self.group = None


def submit(executor, client_id: str, header: dict, tensor: torch.Tensor, **options):
    """A call from a request's header: one base layer's, or a MoE projection's experts' (`counts` in it)."""
    if "counts" in header:
        return executor.submit_experts(client_id, header["op"], str(header.get("layer")), tensor, header["counts"],
                                       inference=bool(header.get("inference")), **options)
    return executor.submit(client_id, header["op"], str(header.get("layer")), tensor,
                           inference=bool(header.get("inference")), **options)


class _ClientPlane:
    """The executor's end for one client: its process group and a thread that serves its calls in order."""

    def __init__(self, client_id: str, backend: str, group_factory: Callable, executor, answer: Callable,
                 drop: Callable, timeout_s: float):
        self.client_id, self.backend, self.executor = client_id, backend, executor
        self.answer, self.drop, self.timeout = answer, drop, datetime.timedelta(seconds=timeout_s)
        self.wire_device = executor.device if backend == "nccl" else torch.device("cpu")
        self.calls: queue.Queue = queue.Queue()
        self.group = self.sending = None
        self._factory = group_factory
        self._thread = threading.Thread(target=self._serve, name=f"symbiosis-{client_id}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.group = self._factory()
            _HOLDERS.add(self)
        except Exception as e:  # noqa: BLE001 -- the client never joined (died attaching): it goes
            log.warning("client %s: no data plane (%s): detaching it", self.client_id, e)
            self.drop(self.client_id)
            return
        while (item := self.calls.get()) is not None:
            identity, header = item
            try:
                self._one(identity, header)
            except Exception as e:  # noqa: BLE001 -- the data plane is out of step, or gone: the client goes
                log.warning("client %s: data plane failed (%s): detaching it", self.client_id, e)
                self.answer(identity, wire.error_reply(header.get("id"), ExecutorUnavailable(
                    f"the nccl:// data plane of client {self.client_id} failed: {e}")))
                self.drop(self.client_id)
                return

    def _one(self, identity: bytes, header: dict) -> None:
        x = torch.empty(header["rows"], header["cols"], dtype=self.executor.dtype, device=self.wire_device)
        log.debug("client %s: %s %s: receiving its input", self.client_id, header["op"], header["layer"])
        _arrived(self.group.recv([x], 1, 0), self.backend, self.timeout, "the call's input")
        try:
            future = submit(self.executor, self.client_id, header, x)
            y = future.result().to(self.wire_device).contiguous()
        except Exception as error:  # the call's own error (a bad layer, out of memory): answered, nothing sent
            self.answer(identity, wire.error_reply(header.get("id"), error))
            return
        log.debug("client %s: %s %s: computed, sending", self.client_id, header["op"], header["layer"])
        # The reply first: the client posts its recv once it has it, and a send may block until that recv is
        # posted (NCCL's connection set-up, should a message ever need a connection attach did not make).
        self.answer(identity, {"id": header.get("id"), "ok": True})
        # Not waited for (held until the next call's, so that `y` and the send live until it went): the next receive
        # queues behind it on the pair's connection, so a client that never takes its result is caught by that
        # receive's deadline.
        self.sending = self.group.send([y], 1, 0)

    def close(self) -> None:
        self.calls.put(None)


class DataPlanes:
    """The executor server's side of `nccl://`: its TCPStore (made at the first such client) and a plane per
    client. `answer(identity, header)` replies on the server's socket (from any thread); `drop(client_id)`
    detaches a client."""

    def __init__(self, executor, answer: Callable, drop: Callable, timeout_s: float):
        self.executor, self.answer, self.drop, self.timeout_s = executor, answer, drop, timeout_s
        self.planes: dict[str, _ClientPlane] = {}
        self._store = None
        self._port = None

    def admit(self, client_id: str, request: dict) -> dict:
        backend = request.get("backend") if isinstance(request, dict) else None
        if backend not in ("nccl", "gloo"):
            raise BadCall(f"unknown data plane {backend!r}: nccl or gloo")
        if backend == "nccl" and self.executor.device.type != "cuda":
            raise BadCall("this executor computes on the CPU: attach over gloo:// or tcp://, not nccl://")
        if self._store is None:
            with socket.socket() as s:
                s.bind(("", 0))
                self._port = s.getsockname()[1]
            self._store = dist.TCPStore("0.0.0.0", self._port, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        # The store answers anyone who reaches its port: a client's group is found under a secret only its attach
        # reply carries (to the tenant whose token was checked), so no other tenant can take the client's rank.
        prefix = f"{client_id}/{secrets.token_hex(16)}"
        factory = lambda: _group(backend, "", self._port, prefix, 0, self.timeout_s,  # noqa: E731
                                 self.executor.device, store=self._store)
        self.planes[client_id] = _ClientPlane(client_id, backend, factory, self.executor, self.answer, self.drop,
                                              self.timeout_s)
        return {"port": self._port, "prefix": prefix}

    def call(self, identity: bytes, header: dict, max_call_tokens: int) -> None:
        """A call whose tensor comes over the data plane: checked here (before anything is received), served
        in order on the client's own thread."""
        plane = self.planes.get(header.get("client"))
        if plane is None:
            raise BadCall("this client attached without a data plane: send its tensors in the message")
        rows, cols = header.get("rows"), header.get("cols")
        if not isinstance(rows, int) or not isinstance(cols, int) or rows < 0 or cols < 1:
            raise BadCall(f"a call over the data plane needs integer rows and cols, got {rows!r} and {cols!r}")
        if header.get("dtype") != wire.dtype_name(self.executor.dtype):
            raise BadCall(f"calls over the data plane are in {self.executor.dtype}, not {header.get('dtype')!r}")
        op, layer_id = header.get("op"), str(header.get("layer"))
        layer = self.executor.weights.get(layer_id) if "counts" not in header else \
            self.executor.weights.experts.get(layer_id)
        check_call(layer_id, None if layer is None else layer.spec, op,
                   torch.empty(rows, cols, device="meta"), max_call_tokens)
        plane.calls.put((identity, header))

    def forget(self, client_id: str) -> None:
        plane = self.planes.pop(client_id, None)
        if plane is not None:
            plane.close()

