"""Per-layer batching: calls of many clients for the same (layer, op) become one token-flattened GEMM.

Clients submit calls from any thread (in-process sessions, transport servers); one worker thread owns the
compute. It asks the policy what to run, concatenates the chosen calls along the token dimension (no
padding: [T1, d] ++ [T2, d] -> [T1+T2, d]), runs the layer once, splits the result back per call and
resolves each call's future.

CUDA streams: a batch runs on the stream of the thread that runs it (the worker's default stream, an inline
caller's own) or on its layer's own (a layer on another GPU of this process, executor/peers.py). A call made on
another stream is read there only after an event its caller's stream recorded at submit, and its caller's stream
waits for the batch's event when it takes the result (`StreamFuture`). Tenants on threads and streams of their
own thus share batches without any host synchronization; callers on the default stream pay nothing for it.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from symbiosis.errors import UnknownClient
from symbiosis.executor.policy import ACTIVE_WINDOW, ClientCounts, Decision, Policy, QueuedCall, QueueKey, Queues
from symbiosis.executor.stats import ExecutorStats

RunBatch = Callable[..., torch.Tensor]  # (key, [T, d_in], counts per expert or None) -> [T, d_out]
HomeStream = Callable[[QueueKey], "torch.cuda.Stream | None"]  # where a key's batches run (None: the worker's)


class StreamFuture(Future):
    """A call's future. Where its output was made on another CUDA stream than its caller's, `result()` makes the
    calling thread's current stream wait for it, and tells the allocator that stream uses it."""

    computed: "torch.cuda.Event | None" = None  # recorded on the stream that made the output

    def result(self, timeout: float | None = None) -> torch.Tensor:
        out = super().result(timeout)
        if self.computed is not None:
            stream = torch.cuda.current_stream(out.device)
            stream.wait_event(self.computed)
            out.record_stream(stream)
        return out


@dataclass
class PendingCall(QueuedCall):
    tensor: torch.Tensor = None
    future: StreamFuture = field(default_factory=StreamFuture)
    ready: "torch.cuda.Event | None" = None  # recorded on the caller's stream once `tensor` is written
    stream_id: int | None = None  # the caller's stream (CUDA), which wrote `tensor`
    gate: Callable[[], None] | None = None  # queues on the GPU what reading `tensor` must wait for
    segments: list[int] | None = None  # a MoE projection's call: rows per expert, `tensor` grouped by expert


def _current_stream_id(device: torch.device) -> int:
    """The calling thread's current stream on `device`, as an id (no Stream object made: this is per call)."""
    return torch._C._cuda_getCurrentStream(device.index if device.index is not None else torch.cuda.current_device())[0]


@functools.cache
def _default_stream_id(device: torch.device) -> int:
    return torch.cuda.default_stream(device).stream_id


def _by_expert(calls: list[PendingCall], x: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Several calls of one MoE projection, each grouped by expert, as one: (x grouped by expert across the calls,
    rows per expert, the order taken, None for a single call, which is grouped already)."""
    if len(calls) == 1:
        return x, calls[0].segments, None
    experts = torch.arange(len(calls[0].segments))
    owner = torch.cat([experts.repeat_interleave(torch.tensor(c.segments)) for c in calls])  # expert of each row
    order = torch.argsort(owner, stable=True).to(x.device)  # by expert; within one, by call
    return x[order], torch.bincount(owner, minlength=len(experts)).tolist(), order


def _split_rows(y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Split [sum T, d] into [T_i, d] pieces that share y's storage but are not autograd views: a client's
    autograd Function returns its piece, and PEFT adds to it in place, which autograd forbids on views."""
    if len(sizes) == 1:
        return [y]
    y = y.contiguous()
    pieces, offset = [], y.storage_offset()
    for rows in sizes:
        piece = torch.empty(0, dtype=y.dtype, device=y.device)
        piece.set_(y.untyped_storage(), offset, (rows, y.shape[1]), y.stride())
        pieces.append(piece)
        offset += rows * y.shape[1]
    return pieces


class Batcher:
    def __init__(self, run_batch: RunBatch, policy: Policy, attached: Callable[[], int], stats: ExecutorStats,
                 home_stream: HomeStream | None = None):
        self.run_batch = run_batch
        self.home_stream = home_stream or (lambda key: None)
        self.policy = policy
        self.attached = attached
        self.stats = stats
        self.queues = Queues()
        self.last_call: dict[str, float] = {}  # client id -> arrival time of its latest call
        self._cond = threading.Condition()
        self._closed = False
        self._worker_running = False  # a batch is being computed on the worker thread
        self._worker = threading.Thread(target=self._serve, name="symbiosis-batcher", daemon=True)
        self._worker.start()

    def submit(self, client_id: str, key: QueueKey, tensor: torch.Tensor, inference: bool,
               inline: bool = False, gate: Callable[[], None] | None = None,
               segments: list[int] | None = None) -> Future:
        """Queue a call. With `inline`, a call the policy would run at once (say, the only active client's)
        runs on the caller's thread, saving the hand-off to the worker: the in-process fast path. `gate` is
        called right before the call's input is read (a pipelined client's input may not be there yet).
        `segments`: a MoE projection's call, its rows per expert (calls of one key all have them)."""
        ready, stream_id = None, None
        if tensor.is_cuda:  # an event only where the batch may run on another stream than this caller's
            stream_id = _current_stream_id(tensor.device)
            if stream_id != _default_stream_id(tensor.device) or self.home_stream(key) is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(tensor.device))
        call = PendingCall(client_id, tensor.shape[0], inference, time.perf_counter(), gate is None, tensor, gate=gate,
                           segments=segments, ready=ready, stream_id=stream_id)
        with self._cond:
            self.last_call[client_id] = call.arrived
            self.queues.by_key.setdefault(key, []).append(call)
            decision = self._decide() if inline else None
            batch = self._take(decision) if decision is not None and decision.key is not None else None
            if batch is None:
                self._cond.notify()
        if batch is not None:
            self._run(*batch)
        return call.future

    @property
    def busy(self) -> bool:
        """Work is queued, or the worker is computing: a thread that would otherwise spin should sleep and
        leave the GIL to the worker. (Read without the lock: a stale answer only costs one poll.)"""
        return bool(self.queues.by_key) or self._worker_running

    def drop_client(self, client_id: str) -> None:
        """Forget a departed client's queued calls (their futures fail; nobody waits on them)."""
        with self._cond:
            self.last_call.pop(client_id, None)
            for key, queued in list(self.queues.by_key.items()):
                for call in queued:
                    if call.client_id == client_id:
                        call.future.set_exception(UnknownClient(f"client {client_id!r} detached"))
                self._requeue(key, [c for c in queued if c.client_id != client_id])
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._worker.join(timeout=5)

    def _decide(self) -> Decision:
        now = time.perf_counter()
        active = sum(now - t < ACTIVE_WINDOW for t in self.last_call.values())
        clients = ClientCounts(attached=max(1, self.attached()), active=max(1, active))
        return self.policy.decide(self.queues, now, clients)

    def _take(self, decision: Decision) -> tuple[QueueKey, list[PendingCall]]:
        queued = self.queues.by_key[decision.key]
        if decision.single:
            taken, kept = queued[:1], queued[1:]
        elif decision.only_inference:
            taken, kept = [c for c in queued if c.inference], [c for c in queued if not c.inference]
        else:
            taken, kept = queued, []
        self._requeue(decision.key, kept)
        return decision.key, taken

    def _requeue(self, key: QueueKey, kept: list[PendingCall]) -> None:
        """What stays queued under `key`; an empty queue is removed (the policy sees only live keys)."""
        if kept:
            self.queues.by_key[key] = kept
        else:
            del self.queues.by_key[key]

    def _next_batch(self) -> tuple[QueueKey, list[PendingCall]] | None:
        with self._cond:
            while not self._closed:
                if not self.queues.by_key:
                    self._cond.wait()
                    continue
                decision = self._decide()
                if decision.key is None:
                    self._cond.wait(decision.wait)
                    continue
                return self._take(decision)
        return None

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            key, calls = batch
            self._worker_running = True
            started = time.perf_counter()
            try:
                self._run(key, calls)
            finally:
                self._worker_running = False
                self.stats.add_busy("batcher", time.perf_counter() - started)

    def _run(self, key: QueueKey, calls: list[PendingCall]) -> None:
        home = self.home_stream(key)
        with torch.cuda.stream(home) if home is not None else nullcontext():
            self._run_on(key, calls)

    def _run_on(self, key: QueueKey, calls: list[PendingCall]) -> None:
        """The batch on this thread's current stream; calls made on other streams ordered against it by events."""
        now = time.perf_counter()
        device = calls[0].tensor.device
        running = _current_stream_id(device) if device.type == "cuda" else None
        foreign = [c for c in calls if c.stream_id != running]  # made on another stream than the batch runs on
        stream = torch.cuda.current_stream(device) if foreign else None
        try:
            for call in calls:
                if call.gate is not None:
                    call.gate()
            if any(call.ready is None for call in foreign):  # made on the default stream, which records no event
                stream.wait_stream(torch.cuda.default_stream(device))
            for call in foreign:
                if call.ready is not None:
                    stream.wait_event(call.ready)
                call.tensor.record_stream(stream)
            started = self.stats.timer()  # after the gates: the GPU time of the GEMM, not of waiting for input
            # [T1, d] ++ [T2, d] ++ ... -> [sum T, d]; one GEMM; split back.
            x = calls[0].tensor if len(calls) == 1 else torch.cat([c.tensor for c in calls])
            if calls[0].segments is None:
                y = self.run_batch(key, x)
            else:  # a MoE projection: the calls' rows regrouped by expert, one grouped GEMM, put back
                grouped, counts, order = _by_expert(calls, x)
                y = self.run_batch(key, grouped, counts)
                if order is not None:
                    y = torch.empty_like(y).index_copy_(0, order, y)
            outputs = _split_rows(y, [c.tokens for c in calls])
        except Exception as error:  # e.g. out of memory: retry alone, so one large call fails alone
            if len(calls) > 1:
                for call in calls:
                    self._run_on(key, [call])
                return
            calls[0].future.set_exception(error)
            return
        self.stats.record(key, [now - c.arrived for c in calls], x.shape[0], started)
        if foreign:
            done = torch.cuda.Event()
            done.record(stream)
            for call in foreign:
                call.future.computed = done
        for call, out in zip(calls, outputs):
            call.future.set_result(out)
