"""The `nccl://` transport: a client on another GPU (or host) whose activations travel over torch.distributed
point-to-point, NCCL between GPUs (no copy through host memory), gloo where a side computes on the CPU (the
tests' `gloo://`). Requests, replies and errors go over the executor's ZeroMQ socket as for `tcp://`
(`nccl://host:port` is the executor's `tcp://host:port`); only the tensors take the data plane.

At attach each such client gets a process group of its own, two ranks (the executor 0, the client 1), whose ranks
meet through a store of that client's own on the executor, reached over the same authenticated ZeroMQ socket
(`rendezvous.py`; no port of its own): clients come and go without a world-wide group. Per call, in this order
on both sides:

    client:   post send(x)  ->  post request {op, layer, rows, cols}  ->  post recv(y)  ->  return y
    executor: recv(x) (the client's own worker thread)  ->  the executor computes  ->  reply, then post send(y)

On NCCL, a client the executor would serve alone (the only one attached, or policy `none`: as an in-process client
runs the executor's layer on its own thread) has its calls chained on the executor's GPU: at the header its thread
posts the receive, the layer and the send on the pair's own stream, and replies, without waiting for the input. A
call's round trip is then the GPU's (the transfer, the GEMM, the transfer back); the executor's host waking on each
input's arrival was most of a remote call's time (~0.4 ms of ~0.5). Otherwise the thread waits for the input on
the host and hands the call to the batcher (shared with the other clients'), whose streams never wait for a
client's data.

The first session of a process on a GPU waits for nothing (a pipelined session, as `ipc/pipelined.py`, whose
claim it shares): its CPU runs ahead of its GPU, and the replies are collected at its later calls and at
`synchronize` (the end of the model's forward and of each backward), which raise the first error among them.
Other sessions of that process and GPU wait for each reply before they post their receive (why: the class).
Both sides stay in step whatever happens to a call: an error after the input arrived (out of memory) is
answered, and zeros of the result's shape are sent in its place; a header the executor refuses (the client checks its calls as the executor does, so only a client that
did not) or a data plane that fails detaches the client, and the client aborts its end, so that the receive it
posted does not hold its stream.

Like `tcp://`'s messages (auth.py), the tensors travel unencrypted (NCCL's always do): on a network you do not
trust, carry both inside a tunnel. The executor receives a call's input only once its header arrived and was
checked (rows, width, dtype), on the client's own thread, with the session timeout: a client that never sends
its tensor stalls only itself, and is detached.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import functools
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from symbiosis.errors import BadCall, ExecutorUnavailable, SymbiosisError
from symbiosis.protocol import check_call, result_width
from symbiosis.transport import wire
from symbiosis.transport.ipc import pipelined
from symbiosis.transport.rendezvous import ChannelStore, PairStore
from symbiosis.transport.remote import RemoteSession, gpu_reached

log = logging.getLogger("symbiosis")
_HOLDERS: "weakref.WeakSet" = weakref.WeakSet()  # sessions and planes holding a process group


@atexit.register
def _release_groups() -> None:
    """Process groups left to the interpreter's teardown abort the process (their C++ threads are destroyed
    while joinable): release them first. (Nothing else: a process that never made one is left alone; a garbage
    collection here made other processes' teardown abort now and then.)"""
    for holder in list(_HOLDERS):
        holder.group = holder._sending = None
SCHEMES = {"nccl": "nccl", "gloo": "gloo"}  # URL scheme -> backend of the data plane
CHAINED_DEPTH = 4  # a chained client's calls queued on the executor's GPU and not yet arrived, at most
MIN_QUEUES = 32  # CUDA_DEVICE_MAX_CONNECTIONS for a process of several nccl:// sessions (`_warn_few_queues`)


def control_url(url: str) -> str:
    """The executor's ZeroMQ endpoint behind a data-plane URL: nccl://host:port -> tcp://host:port."""
    parsed = urlparse(url)
    return f"tcp://{parsed.netloc}"


def _group(backend: str, store: dist.Store, rank: int, timeout_s: float, device: torch.device):
    """This side's two-rank process group for one client, its ranks meeting in `store` (blocks until the other
    side joins)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("pair", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        # NCCL's watchdog is the net under our own deadlines (`DataPlanes._watch`), which come first and say why
        options._timeout = 2 * timeout + datetime.timedelta(seconds=30)
        torch.cuda.set_device(device)
        # A pair's operation that outlives the timeout (a client that never sent, or never received) must abort that
        # pair's communicator only: NCCL's watchdog otherwise tears the whole process down (its default, 3), every
        # other tenant with it. The setting is read when a group is made: ours get 2 (abort the communicator, raise
        # in its waits), other groups of this process keep what their owner chose.
        chosen = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        # torch's flight recorder (2,000 entries by default) captures the Python stack of every NCCL operation, for
        # dumps after a hang. A pair makes two an executor call on each side, under a model's deep stack: on two
        # H100s, one remote Llama-3.2-1B client's step took 0.172 s with it and 0.140 s without. torch reads it once
        # a process: one that set it (by either of its names; torch 2.11 prefers the second) keeps what it asked
        # for, as does one whose NCCL groups recorded before this.
        if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
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


@functools.cache
def _warn_few_queues() -> None:
    """Once a process: its second nccl:// session on a GPU, with the GPU's streams sharing 8 hardware queues."""
    if int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") or 8) < MIN_QUEUES:
        log.warning("several nccl:// sessions in one process: set CUDA_DEVICE_MAX_CONNECTIONS=%d before CUDA starts "
                    "(`symbiosis executor` does). Their send and receive kernels spin until their peer's match "
                    "is posted, and with the default 8 hardware queues one can hold up another's: four client "
                    "threads hung", MIN_QUEUES)


class CollectiveSession(RemoteSession):
    """A client's session over `nccl://` (or `gloo://`): control over ZeroMQ, tensors over its process group.
    Pipelined (the first of its process on its GPU; always on gloo): a call posts its send, its request and its
    receive, and returns; the replies are collected at later calls and at `synchronize` (the end of the model's
    forward and of each backward), which raise the first error among them. Otherwise a call waits for its reply
    before it posts its receive."""

    grouped_experts = True
    whole_blocks = True

    def __init__(self, executor, fingerprint: str, name: str, device: torch.device):
        self.backend = executor.data_plane
        if self.backend == "nccl" and device.type != "cuda":
            raise ValueError("nccl:// carries GPU tensors: attach the client on a CUDA device (gloo:// for the CPU)")
        # One session per process and GPU pipelines (as on ipc://, and sharing its claim); the others wait for each
        # reply before they post their receive. Each pipelined session keeps a receive kernel waiting on its
        # GPU: several of them, with their streams, outnumber the GPU's hardware queues (8 by default), a waiting
        # kernel then holds up other streams' work behind it, and sessions of one process deadlocked (8 threads).
        self.pipelined = self.backend == "gloo" or pipelined.claim(device)
        if not self.pipelined:
            _warn_few_queues()
        self._claim = weakref.finalize(self, pipelined.give_back, device.index) \
            if self.pipelined and self.backend == "nccl" else None
        self.group = self._sending = self.rendezvous = None
        self._unanswered: set[int] = set()  # ids of calls whose replies have not come yet
        super().__init__(executor, fingerprint, name, device)

    def _attach_request(self) -> dict:
        return {"collective": {"backend": self.backend}}

    def _take_shared(self, reply: dict) -> None:
        plane = reply.get("collective")
        if not plane:
            raise ExecutorUnavailable("the executor did not open a data plane for this nccl:// client")
        if self.rendezvous is not None:  # an earlier attach's (reconnect)
            self.rendezvous.close()
        # Kept while the group lives: a process group may look at its store again (NCCL's monitor, for a dump)
        self.rendezvous = ChannelStore(self.executor.url, self.executor.timeout, self.executor.token, reply["client"])
        try:
            self.group = _group(self.backend, self.rendezvous, 1, self.executor.timeout, self.device)
        except (RuntimeError, ValueError, SymbiosisError) as e:  # the executor's rank never joined in time
            raise ExecutorUnavailable(f"the {self.backend}:// data plane could not be set up with the executor at "
                                      f"{self.executor.url}: {str(e).splitlines()[0] if str(e) else e!r}") from e
        _HOLDERS.add(self)
        self._unanswered.clear()
        self.wire_device = self.device if self.backend == "nccl" else torch.device("cpu")

    def _call(self, op: str, layer_id: str, tensor: torch.Tensor, out_width: int, inference: bool,
              counts: list[int] | None = None) -> torch.Tensor:
        sent = tensor.detach().to(self.wire_device, self.dtype).contiguous()
        header = {"op": op, "layer": layer_id, "inference": inference, "collective": True, "client": None,
                  "rows": sent.shape[0], "cols": sent.shape[1], "dtype": wire.dtype_name(self.dtype)}
        if counts is not None:  # a MoE projection's experts: `layer_id` names them, `counts` their rows
            header["counts"] = counts
        with self._call_lock:
            self._check_open()
            self.calls += 1
            started = time.perf_counter()
            header["client"] = self.client_id
            # The executor receives, computes and sends back whatever the reply says (an error's zeros): a
            # pipelined session posts its receive at once, and its CPU runs on while both GPUs work.
            group = self.group  # the heartbeat's thread may abort and drop it meanwhile: the recv then raises
            self._sending = group.send([sent], 0, 0)  # held: gloo cancels a send whose work is dropped
            self._unanswered.add(self.channel.post(header))
            error = None if self.pipelined else self._replies(block=True)
            self._check_open()  # a reply that the data plane failed: nothing comes
            result = torch.empty(sent.shape[0], out_width, dtype=self.dtype, device=self.wire_device)
            try:
                group.recv([result], 0, 0).wait()  # NCCL: the stream waits; gloo: this thread does
            except RuntimeError as e:  # the data plane closed or was aborted (the executor says why in its reply)
                self._answers(block=True)
                self._lost(f"the {self.backend}:// data plane closed: {e}")
                self._check_open()
            if error is not None:
                wire.raise_error(error)
            self._answers(block=False)
            self.waited_s += time.perf_counter() - started
        return result.to(tensor.device, tensor.dtype)

    def _replies(self, block: bool) -> dict | None:
        """Take the replies that came (`block`: all of them): the first error among them. One that says the data
        plane failed, or the executor's silence, breaks the session (reconnect() attaches again)."""
        try:
            error = self.channel.take_replies(self._unanswered, block)
        except ExecutorUnavailable as e:
            self._lost(str(e))
            raise
        if error is not None and error.get("error") in ("ExecutorUnavailable", "UnknownClient"):
            self._lost(str(error.get("message")))
        return error

    def _answers(self, block: bool) -> None:
        """As `_replies`, raising the first error."""
        if (error := self._replies(block)) is not None:
            wire.raise_error(error)

    def synchronize(self, gpu: bool = False) -> None:
        """Every call so far answered (the first error raised); with `gpu`, also its result received on the GPU."""
        with self._call_lock:
            self._check_open()
            started = time.perf_counter()
            self._answers(block=True)
            if gpu and self.backend == "nccl":
                done = torch.cuda.Event()
                done.record()
                if not gpu_reached(done, self.executor.timeout):
                    self._lost(f"the results did not reach this GPU within {self.executor.timeout:g}s")
            self.waited_s += time.perf_counter() - started
            self._check_open()

    def _request(self, header: dict, *tensors: torch.Tensor, channel=None) -> tuple[dict, list]:
        if channel is None and self._unanswered:  # a request's wait would skip the posted calls' replies
            self._answers(block=True)
        return super()._request(header, *tensors, channel=channel)

    def _lost(self, why: str) -> None:
        """Also abort the data plane: a receive posted for a result that will never come would hold this
        client's stream (and a CPU that waits on it) until NCCL's watchdog."""
        super()._lost(why)
        group, self.group = self.group, None
        if group is not None and self.backend == "nccl":
            group.abort()

    def _before_detach(self) -> None:
        if self._broken is None and self.group is not None:
            try:
                self.synchronize(gpu=True)
            except SymbiosisError:
                pass  # an earlier call's error, or an executor gone: closing regardless

    def close(self) -> None:
        super().close()
        self.group = self._sending = None
        if self.rendezvous is not None:
            self.rendezvous.close()
        if self._claim is not None:
            self._claim()  # another session of this process may pipeline on this GPU now


def submit(executor, client_id: str, header: dict, tensor: torch.Tensor, **options):
    """A call from a request's header: one base layer's, or a MoE projection's experts' (`counts` in it)."""
    if "counts" in header:
        return executor.submit_experts(client_id, header["op"], str(header.get("layer")), tensor, header["counts"],
                                       inference=bool(header.get("inference")), **options)
    return executor.submit(client_id, header["op"], str(header.get("layer")), tensor,
                           inference=bool(header.get("inference")), **options)


class _Arrived:
    """A gloo:// call's input arrival, waited for on the host: always there."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        pass


ARRIVED = _Arrived()


@dataclass
class _Chained:
    """A call run alone: when its receive was posted, its input's arrival (NCCL: an event on the pair's stream), its
    send (held until it went: gloo cancels a send whose work is dropped) and the tensors those use."""
    posted: float
    arrived: "torch.cuda.Event"
    sending: object
    x: torch.Tensor
    y: torch.Tensor


class _ClientPlane:
    """The executor's end for one client: its process group and a thread that serves its calls in order."""

    def __init__(self, client_id: str, backend: str, executor, answer: Callable, drop: Callable, timeout_s: float):
        self.client_id, self.backend, self.executor = client_id, backend, executor
        self.answer, self.drop, self.timeout = answer, drop, datetime.timedelta(seconds=timeout_s)
        self.wire_device = executor.device if backend == "nccl" else torch.device("cpu")
        self.calls: queue.Queue = queue.Queue()
        self.group = self._sending = None
        # NCCL: a receive is waited for on a stream of this plane's own, the thread asleep in an event's
        # synchronize (no GIL held, woken by the driver); `DataPlanes._watch` aborts the pair whose receive has
        # waited past the timeout, which ends the wait.
        self.waiting_since: float | None = None
        self.expired = False
        # Calls run alone (`_one_alone`; on NCCL chained on the GPU), oldest first: each one's input arrival, its
        # send and the tensors both use, held until the next one's input arrived (then its send went: the pair's
        # operations run in order). At most CHAINED_DEPTH; the watch thread reads them.
        self._chained: collections.deque[_Chained] = collections.deque()
        self._chained_lock = threading.Lock()
        if backend == "nccl":
            self._stream = torch.cuda.Stream(executor.device)
            self._arrived = torch.cuda.Event(blocking=True)
            self._arrivals = [torch.cuda.Event(blocking=True) for _ in range(CHAINED_DEPTH + 1)]  # (reused in turn)
            self._next_arrival = 0
        self.rendezvous = PairStore(timeout_s)  # where the client's rank meets this one (its requests: `serve`)
        self._thread = threading.Thread(target=self._serve, name=f"symbiosis-{client_id}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.group = _group(self.backend, self.rendezvous.store, 0, self.timeout.total_seconds(),
                                self.executor.device)
            _HOLDERS.add(self)
        except Exception as e:  # noqa: BLE001 -- the client never joined (died attaching): it goes
            log.warning("client %s: no data plane (%s): detaching it", self.client_id, e)
            self.drop(self.client_id)
            return
        while (item := self.calls.get()) is not None:
            identity, header, out_width = item
            try:
                if self._alone(header):
                    self._one_alone(identity, header, out_width)
                else:
                    self._one(identity, header, out_width)
            except Exception as e:  # noqa: BLE001 -- the data plane is out of step, or gone: the client goes
                log.warning("client %s: data plane failed (%s): detaching it", self.client_id, e)
                self._abandon()
                self.drop(self.client_id)  # before the answer: a client told it is gone is gone
                self.answer(identity, wire.error_reply(header.get("id"), ExecutorUnavailable(
                    f"the nccl:// data plane of client {self.client_id} failed: {e}")))
                return
        if self.group is not None and self._chained and not self._chained[-1].sending.is_completed():
            self._abandon()  # detached with a chained call still on the GPU: it would hold the stream for ever

    def _receive(self, x: torch.Tensor) -> None:
        """Until `x` arrived (at most the timeout). Only this plane's stream ever waits for a client's data: the
        shared streams take `x` once it is there, so a client that never sends holds up nobody else. (NCCL's own
        `wait(timeout)` would hold the current stream, and look at the receive once a millisecond, which was most
        of a remote call's time; gloo's wait is woken by the data itself.)"""
        work = self.group.recv([x], 1, 0)
        if self.backend != "nccl":
            work.wait(self.timeout)
            return
        with torch.cuda.stream(self._stream):
            work.wait()
            self._arrived.record()
        self.waiting_since = time.monotonic()
        self._arrived.synchronize()
        self.waiting_since = None
        if self.expired:
            raise TimeoutError(f"the call's input did not arrive within {self.timeout.total_seconds():g} s")

    def overdue(self, now: float) -> bool:
        """From the watch thread: an input this plane waits for, on the host or on the GPU (a chained call's), did
        not arrive within the timeout."""
        since = self.waiting_since
        if since is not None and now - since > self.timeout.total_seconds():
            return True
        with self._chained_lock:
            for call in self._chained:  # (arrivals come in order: the first one not arrived is the oldest)
                if not call.arrived.query():
                    return now - call.posted > self.timeout.total_seconds()
        return False

    def expire(self) -> None:
        """From the watch thread: an input waited past the timeout; aborting the pair ends its receive. A chained
        call's thread is not waiting for it: the client is detached from here."""
        if not self.expired and self.group is not None:
            self.expired = True
            self.group.abort()
            if self.waiting_since is None:
                self.drop(self.client_id)

    def _abandon(self) -> None:
        """Abort a failed pair's communicator here, on purpose: its receive is still pending, and a process group
        destroyed with work in flight (wherever its last reference happens to go) takes the process down."""
        group, self.group, self._sending = self.group, None, None
        if self.backend == "nccl" and group is not None and not self.expired:
            group.abort()

    def _alone(self, header: dict) -> bool:
        """Whether this call runs here, at once, batched with nothing: its client is served alone (the executor's
        only client, or policy `none`) and the layer is on the executor's device (a shard's is a round trip of its
        own). On NCCL it is then chained on the GPU (the class)."""
        executor = self.executor
        if not (len(executor.clients) == 1 or executor.policy.name == "none"):
            return False
        layer = executor.weights.experts.get(header["layer"]) if "counts" in header else \
            executor.weights.get(header["layer"])
        return layer is not None and getattr(layer, "local", True)

    def _one_alone(self, identity: bytes, header: dict, out_width: int) -> None:
        """Receive, compute and send, on this thread with no hand-off; on NCCL on this plane's stream, none of it
        waited for here (gloo's receive is waited for: the CPU computes with it)."""
        self._settle(CHAINED_DEPTH - 1)
        with torch.cuda.stream(self._stream) if self.backend == "nccl" else contextlib.nullcontext():
            x = torch.empty(header["rows"], header["cols"], dtype=self.executor.dtype, device=self.wire_device)
            posted = time.monotonic()
            if self.backend == "nccl":
                arrived = self._arrivals[self._next_arrival]
                self._next_arrival = (self._next_arrival + 1) % len(self._arrivals)
                self.group.recv([x], 1, 0).wait()  # the stream waits for x, not this thread
                arrived.record()
            else:
                self._receive(x)
                arrived = ARRIVED
            sending, y = self._answer_and_send(identity, header, out_width, lambda: self.executor.run_alone(
                self.client_id, header["op"], str(header["layer"]), x, header.get("counts")))
        with self._chained_lock:
            self._chained.append(_Chained(posted, arrived, sending, x, y))

    def _settle(self, keep: int) -> None:
        """Forget the chained calls whose sends went, and wait (on the host, watched) until at most `keep` are
        left: a client whose CPU runs far ahead of its GPU queues no more than that on the executor's."""
        while len(self._chained) > 1 and (self._chained[1].arrived.query() or len(self._chained) > keep):
            following = self._chained[1]
            if not following.arrived.query():
                self.waiting_since = following.posted
                following.arrived.synchronize()
                self.waiting_since = None
                if self.expired:
                    raise TimeoutError(f"the call's input did not arrive within {self.timeout.total_seconds():g} s")
            with self._chained_lock:
                self._chained.popleft()  # its send ran before the next one's receive (one stream, in order)

    def _one(self, identity: bytes, header: dict, out_width: int) -> None:
        x = torch.empty(header["rows"], header["cols"], dtype=self.executor.dtype, device=self.wire_device)
        log.debug("client %s: %s %s: receiving its input", self.client_id, header["op"], header["layer"])
        self._receive(x)
        with self._chained_lock:
            self._chained.clear()  # chained calls before this one: sent before it arrived
        # The send is not waited for (held until the next call's, so that `y` and the send live until it went): the
        # next receive queues behind it on the pair's connection, so a client that never takes its result is caught
        # by that receive's deadline.
        self._sending, _ = self._answer_and_send(identity, header, out_width, lambda: submit(
            self.executor, self.client_id, header, x).result().to(self.wire_device))

    def _answer_and_send(self, identity: bytes, header: dict, out_width: int, compute: Callable[[], torch.Tensor]):
        """Reply to the call and post its result's send: `compute()`'s, or after the call's own error (out of memory)
        that error and zeros of the result's shape, so that both sides stay in step. (The send's work, its tensor.)"""
        try:
            y, reply = compute().contiguous(), {"id": header.get("id"), "ok": True}
        except Exception as error:  # the call's own error (out of memory): answered
            y = torch.zeros(header["rows"], out_width, dtype=self.executor.dtype, device=self.wire_device)
            reply = wire.error_reply(header.get("id"), error)
        log.debug("client %s: %s %s: computed, sending", self.client_id, header["op"], header["layer"])
        self.answer(identity, reply)
        return self.group.send([y], 1, 0), y

    def close(self) -> None:
        self.calls.put(None)


class DataPlanes:
    """The executor server's side of `nccl://`: a plane per client. `answer(identity, header)` replies on the
    server's socket (from any thread); `drop(client_id)` detaches a client."""

    def __init__(self, executor, answer: Callable, drop: Callable, timeout_s: float):
        self.executor, self.answer, self.drop, self.timeout_s = executor, answer, drop, timeout_s
        self.planes: dict[str, _ClientPlane] = {}
        self._watching = False
        self._watch_lock = threading.Lock()

    def _watch(self) -> None:
        """Expire the NCCL receives that waited longer than the timeout (a client that never sent its tensor)."""
        while True:
            time.sleep(min(0.25, self.timeout_s / 8))
            with self._watch_lock:
                if not self.planes:  # ends with the last client (the next nccl:// attach starts it again)
                    self._watching = False
                    return
            now = time.monotonic()
            for plane in list(self.planes.values()):
                if plane.overdue(now):
                    log.warning("client %s: its input did not arrive within %g s: aborting its data plane",
                                plane.client_id, self.timeout_s)
                    plane.expire()

    def admit(self, client_id: str, request: dict) -> dict:
        backend = request.get("backend") if isinstance(request, dict) else None
        if backend not in ("nccl", "gloo"):
            raise BadCall(f"unknown data plane {backend!r}: nccl or gloo")
        if backend == "nccl" and self.executor.device.type != "cuda":
            raise BadCall("this executor computes on the CPU: attach over gloo:// or tcp://, not nccl://")
        plane = _ClientPlane(client_id, backend, self.executor, self.answer, self.drop, self.timeout_s)
        with self._watch_lock:
            self.planes[client_id] = plane
            if backend == "nccl" and not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="symbiosis-data-planes", daemon=True).start()
        return {"backend": backend}  # the client's rank meets ours through `rendezvous`

    def rendezvous(self, client_id: str, header: dict) -> dict:
        """A client's request to its pair's store (the I/O thread: answered at once, never waited in)."""
        plane = self.planes.get(client_id)
        if plane is None:
            raise BadCall("this client attached without a data plane: it has no rendezvous store")
        return plane.rendezvous.serve(header)

    def call(self, identity: bytes, header: dict, max_call_tokens: int) -> None:
        """A call whose tensor comes over the data plane: checked here (before anything is received), served
        in order on the client's own thread."""
        plane = self.planes.get(header.get("client"))
        if plane is None:
            raise BadCall("this client attached without a data plane: send its tensors in the message")
        rows, cols = header.get("rows"), header.get("cols")
        op, layer_id = header.get("op"), str(header.get("layer"))
        try:
            if type(rows) is not int or type(cols) is not int or not 0 <= rows <= max_call_tokens or \
                    not 1 <= cols <= 1 << 24:  # noqa: E721 -- not bools; bounded before any tensor is shaped by them
                raise BadCall(f"a call over the data plane needs integer rows (0..{max_call_tokens}) and cols, got "
                              f"{str(rows)[:40]} and {str(cols)[:40]}")
            if header.get("dtype") != wire.dtype_name(self.executor.dtype):
                raise BadCall(f"calls over the data plane are in {self.executor.dtype}, not {header.get('dtype')!r}")
            layer = self.executor.weights.get(layer_id) if "counts" not in header else \
                self.executor.weights.experts.get(layer_id)
            check_call(layer_id, None if layer is None else layer.spec, op,
                       torch.empty(rows, cols, device="meta"), max_call_tokens)
        except SymbiosisError as e:
            # The client checks its calls as this does (protocol.py) and has posted its tensor and its receive
            # already: a call refused here leaves the pair out of step for good.
            self.drop(header["client"])
            raise ExecutorUnavailable(f"{e}; the client sent its tensor regardless, so its data plane is out of "
                                      "step: it is detached") from e
        plane.calls.put((identity, header, result_width(layer.spec, op)))

    def forget(self, client_id: str) -> None:
        plane = self.planes.pop(client_id, None)
        if plane is not None:
            plane.close()

