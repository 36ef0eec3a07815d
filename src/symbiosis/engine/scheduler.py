"""Which tokens run in the next step: continuous batching with chunked prefill, over a paged KV pool.

Each step has a token budget (`max_batch_tokens`). Running requests that are decoding go first, one token each,
oldest first; then prefills (running ones that are part way, then waiting ones, oldest first) take what is left
of the budget, cut into chunks, so a long prompt never holds up the decodes. A request joins when its first chunk
and its adapter fit; it leaves the moment it finishes. Waiting requests of several owners (the service's tenants)
join in turns: the owner with the fewest running first, then the one served longest ago (`_admission_order`).

`admit_batch`: while requests are running, waiting ones join only once that many slots of `max_running` are free
(or as many as are waiting). A step with a prefill chunk runs eagerly; a step of decodes alone replays its CUDA
graph, for a fraction of the host's time (engine/graphs.py). At saturation a slot frees nearly every step, so
admitting each request as its slot frees puts a prefill chunk in nearly every step. Admitting them k at a time
leaves k-1 steps of every k decode-only, at the cost of a freed slot staying empty for up to k-1 steps. With 1,
each request joins as soon as a slot frees. Below saturation the free slots are there and nothing waits. The
engine's default is an eighth of `max_running`: on an H100 (Llama-3-8B, 64 adapters, 96 running, 512 requests at
64/s) 12 at a time doubled the tokens/s of 1 at a time (2,046 against 1,105) and cut time to first token 3x, with
83% of steps graph replays against 54% (docs/PERFORMANCE.md section 9).

When a running request needs a block and the pool has none, the newest running request not yet in this step is
preempted: its blocks go back to the pool and it waits at the head of the queue; when it runs again its prompt
and every token it has made so far are recomputed as a prefill (its output so far is kept, so no token is lost or
made twice).

The engine schedules a step while the step before it still runs (engine.py): a request sampled there has one token
in flight, whose value the host does not know yet (`in_flight_row`: its row of that step's sampled tokens, where
the device reads it). Its next decode takes that token from the device; it is never preempted (its output is not
all known) and not scheduled once the tokens it has and has in flight reach its max_tokens.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import queue
from dataclasses import dataclass, field

import torch

from symbiosis.engine.adapters import AdapterStore, HostAdapter
from symbiosis.engine.batch import Chunk
from symbiosis.engine.kv import BlockPool
from symbiosis.engine.params import SamplingParams
from symbiosis.engine.stops import TextSoFar

_arrivals = itertools.count()


@dataclass(eq=False)  # a request is itself: lists of them are searched by identity, not by comparing every field
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    adapter: HostAdapter | None
    generator: torch.Generator | None
    events: queue.Queue = field(default_factory=queue.Queue)
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens whose keys and values are in the cache
    slot: int | None = None  # adapter slot while running
    arrival: int = field(default_factory=lambda: next(_arrivals))
    preemptions: int = 0
    cancelled: bool = False
    text: str = ""  # the output's text so far (with a tokenizer)
    emitted: int = 0  # characters of `text` already streamed
    text_state: TextSoFar = field(default_factory=TextSoFar)  # how far `text` is decoded (stops.py)
    in_flight_row: int | None = None  # a token sampled by the running step, not read yet: its row there
    in_flight_step: int | None = None  # that step's number
    finished: bool = False
    owner: str | None = None  # whose it is (a tenant): waiting requests are admitted owners in turn

    @property
    def tokens(self) -> list[int]:
        """The tokens the host knows (a token in flight is not among them)."""
        return self.prompt + self.output

    @property
    def length(self) -> int:
        """Tokens so far, a token in flight included."""
        return len(self.prompt) + len(self.output) + (self.in_flight_row is not None)

    @property
    def decoding(self) -> bool:
        return self.computed == self.length - 1

    @property
    def exhausted(self) -> bool:
        """Its tokens, the one in flight included, reach max_tokens: it ends when that one is read."""
        return len(self.output) + (self.in_flight_row is not None) >= self.params.max_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, adapters: AdapterStore, max_batch_tokens: int, max_running: int,
                 admit_batch: int = 1):
        self.pool, self.adapters = pool, adapters
        self.max_batch_tokens, self.max_running, self.admit_batch = max_batch_tokens, max_running, admit_batch
        self.waiting: list[Request] = []  # by arrival
        self.running: list[Request] = []  # by arrival
        self._admitted = itertools.count()
        self._last_turn: dict[str | None, int] = {}  # owner -> when one of its requests was last admitted

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.arrival)

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        scheduled: set[str] = set()
        budget = self.max_batch_tokens
        for request in [r for r in self.running if r.decoding] + [r for r in self.running if not r.decoding]:
            if budget == 0:
                break
            if request.id in scheduled or request not in self.running or request.exhausted:  # preempted meanwhile
                continue
            count = min(request.length - request.computed, budget)
            if not self._grow(request, request.computed + count, scheduled):
                continue
            chunks.append(self._chunk(request, count))
            scheduled.add(request.id)
            budget -= count
        free = self.max_running - len(self.running)
        if self.running and free < min(self.admit_batch, len(self.waiting)):
            return chunks  # (see admit_batch above)
        for request in self._admission_order():
            if not budget or len(self.running) >= self.max_running:
                break
            count = min(request.length, budget)
            if self.pool.blocks_for(count) > self.pool.free:
                break  # joins when blocks free up; admission never preempts
            if request.adapter is not None:
                request.slot = self.adapters.acquire(request.adapter)
                if request.slot is None:
                    break  # every adapter slot is in use by running requests
            self.waiting.remove(request)
            self._last_turn[request.owner] = next(self._admitted)
            request.blocks = self.pool.allocate(self.pool.blocks_for(count))
            self.running.append(request)
            chunks.append(self._chunk(request, count))
            scheduled.add(request.id)
            budget -= count
        return chunks

    def _admission_order(self) -> list[Request]:
        """The waiting requests in the order they may join: with one owner (or none named), by arrival; with
        several, owners take turns: the fewest running first, then the one whose last admission is oldest, each
        owner's own by arrival. (By arrival alone, one tenant's thousand queued sequences held another's one request
        for a minute.)"""
        if len(self.waiting) < 2 or all(r.owner == self.waiting[0].owner for r in self.waiting):
            return list(self.waiting)
        load = collections.Counter(r.owner for r in self.running)  # then each one taken counts as running
        keyed = []
        for request in self.waiting:
            keyed.append((load[request.owner], self._last_turn.get(request.owner, -1), request.arrival, request))
            load[request.owner] += 1
        return [request for *_, request in heapq.nsmallest(self.max_running, keyed, key=lambda k: k[:3])]

    def _chunk(self, request: Request, count: int) -> Chunk:
        start = request.computed
        known = request.tokens[start:start + count]
        in_flight = len(known) < count  # the chunk's last token is the one in flight (a decode)
        return Chunk(request, start, known + [0] * (count - len(known)), request.slot,
                     sample=start + count == request.length,
                     from_row=request.in_flight_row if in_flight else None)

    def _grow(self, request: Request, tokens: int, scheduled: set[str]) -> bool:
        """Blocks for `tokens` positions of `request`, preempting newer unscheduled requests if need be."""
        needed = self.pool.blocks_for(tokens) - len(request.blocks)
        while needed > self.pool.free:
            victims = [r for r in self.running if r.id not in scheduled and r is not request and r.in_flight_row is None]
            if not victims:
                return False
            self.preempt(max(victims, key=lambda r: r.arrival))
        if needed > 0:
            request.blocks += self.pool.allocate(needed)
        return True

    def preempt(self, request: Request) -> None:
        self.finish(request)
        request.computed = 0
        request.preemptions += 1
        self.add(request)

    def finish(self, request: Request) -> None:
        """Out of the running set (or the queue): its blocks and its adapter slot go back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.release(request.blocks)
        if request.slot is not None:
            self.adapters.release(request.slot)
            request.slot = None
