"""From HTTP requests to engine requests and back: admission (bounded, global and per tenant), the engine's
events delivered to the event loop, cancellation when the HTTP client goes, and the request's timings.

The engine's thread puts each request's tokens, then one `Finished`, into an `_EventSink`, which hands them to the
asyncio loop through the loop's inbox (one wake-up per bunch of events, not per token); an HTTP request with
several engine requests (`n` > 1, several prompts) reads all of them from one queue, tagged by choice index, or,
relayed (`Generation.relay`), has them handed to a function on the loop as they come, with no task woken for them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

from symbiosis.engine import Finished, SamplingParams, Token
from symbiosis.serve.errors import ApiError

log = logging.getLogger("symbiosis.serve")


class Admission:
    """At most `total` HTTP requests generating at once, at most `per_tenant` of one tenant; past either, 429
    with Retry-After (nothing is queued without bound: the engine's own queue holds only admitted requests)."""

    def __init__(self, total: int, per_tenant: int):
        self.total, self.per_tenant = total, per_tenant
        self.running: Counter[str] = Counter()
        self._lock = threading.Lock()

    def enter(self, tenant: str) -> None:
        with self._lock:
            if sum(self.running.values()) >= self.total:
                raise ApiError(429, f"the server is at its limit of {self.total} requests at once; retry shortly",
                               code="server_busy", headers={"Retry-After": "1"})
            if self.running[tenant] >= self.per_tenant:
                raise ApiError(429, f"you have {self.per_tenant} requests running, your limit; retry when one "
                               "finishes", code="rate_limit_exceeded", headers={"Retry-After": "1"})
            self.running[tenant] += 1

    def leave(self, tenant: str) -> None:
        with self._lock:
            self.running[tenant] -= 1
            if self.running[tenant] <= 0:
                del self.running[tenant]


class _LoopInbox:
    """Events from other threads for one event loop, handed over in bunches: the first event since the loop last
    emptied the inbox wakes it (`call_soon_threadsafe`: a write to its wake-up pipe); the rest of an engine step's
    events for the loop's requests join that bunch, instead of one wake-up each (64 running requests: 64 a step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, object]] = []
        self._called = False  # whether the loop is called to empty the inbox
        self._lock = threading.Lock()

    def put(self, queue: asyncio.Queue, item, wake: bool = True) -> None:
        """`wake` False: the loop is not called for it until a `wake()` (or a later put that wakes)."""
        with self._lock:
            self._items.append((queue, item))
            if not wake or self._called:
                return
            self._called = True
        self._call()

    def wake(self) -> None:
        with self._lock:
            if not self._items or self._called:
                return
            self._called = True
        self._call()

    def _call(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed (the server stopping): its events are dropped
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._called = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


_INBOXES: dict[int, _LoopInbox] = {}  # id(loop) -> its inbox (uvloop's loops take no weak references)
_INBOXES_LOCK = threading.Lock()


def _inbox(loop: asyncio.AbstractEventLoop) -> _LoopInbox:
    with _INBOXES_LOCK:
        for key in [key for key, inbox in _INBOXES.items() if inbox.loop.is_closed()]:
            del _INBOXES[key]
        inbox = _INBOXES.get(id(loop))
        if inbox is None or inbox.loop is not loop:
            inbox = _INBOXES[id(loop)] = _LoopInbox(loop)
        return inbox


class _EventSink:
    """`put` from the engine's thread, read on the loop (through the loop's inbox, in order) by `target`'s
    `put_nowait`. It holds its target weakly: the engine's request holds the sink, and the generation its requests,
    so a strong reference made a cycle of every HTTP request's objects (its tokens among them), freed only by the
    cyclic collector; once the HTTP handler lets its generation go, nobody reads its events."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target, index: int):
        self.inbox, self.target, self.index = _inbox(loop), weakref.ref(target), index

    def put(self, event, wake: bool = True) -> None:
        target = self.target()
        if target is not None:
            self.inbox.put(target, (self.index, event), wake=wake)

    def put_quietly(self, event) -> None:
        """`put`, without calling the loop until `flush` (the engine's `defer_wakeups`)."""
        self.put(event, wake=False)

    def flush(self) -> None:
        self.inbox.wake()


@dataclass
class Choice:
    """One engine request's progress, as the HTTP layer reports it."""
    index: int
    prompt_tokens: int
    tokens: list[Token] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: Exception | None = None


@dataclass
class Timing:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)  # between consecutive tokens of one choice

    def token(self, previous: float | None) -> float:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        if previous is not None:
            self.gaps.append(now - previous)
        self.last_token = now
        return now


_GONE = object()  # put in a generation's queue when its HTTP client has gone


class Generation:
    """The engine requests of one HTTP request: `await start()`, then read `events()` inside `async with`,
    whose end cancels whatever still runs (the HTTP client went, or an error), which frees its KV blocks in the
    engine's next step."""

    def __init__(self, generator_for, prompts: list[list[int]], params: list[SamplingParams], adapter,
                 owner: str | None = None):
        """`generator_for()`: what generates these requests (the engine, or a split generator), asked at `start`
        off the loop (it may read the adapter from disk); `owner`: the tenant (the engine admits tenants in turns)."""
        self.generator_for, self.prompts, self.params, self.adapter = generator_for, prompts, params, adapter
        self.owner = owner
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles = []
        self.choices = [Choice(i, len(p)) for i, p in enumerate(prompts)]
        self.timing = Timing()
        self._last: dict[int, float] = {}
        self._relay = None
        self._ended: asyncio.Future | None = None
        self.relay_error: Exception | None = None  # what failed in relaying its events (a bug: logged)

    async def start(self) -> None:
        """Submit every request (an error, e.g. a prompt that does not fit, cancels those submitted already)."""
        loop = asyncio.get_running_loop()

        def submit_all():  # reads the adapter from disk on first use: off the loop (one hop to a thread for both)
            generator = self.generator_for()
            for i, (prompt, params) in enumerate(zip(self.prompts, self.params)):
                self.handles.append(generator.submit(prompt, params, self.adapter,
                                                     events=_EventSink(loop, self, i), owner=self.owner))
        try:
            await asyncio.to_thread(submit_all)
        except BaseException:
            self.cancel()
            raise

    def put_nowait(self, item: tuple[int, object]) -> None:
        """(choice index, Token or Finished), on the loop: to the queue, or relayed."""
        if self._relay is None:
            self.queue.put_nowait(item)
            return
        if self.relay_error is not None:
            return
        try:
            self._relay(*self._take(*item))
        except Exception as e:  # noqa: BLE001 -- a bug here must not lose the other requests' events of the bunch
            log.exception("relaying a generation's event failed; the generation is cancelled")
            self.relay_error = e
            self.cancel()
        if (self.done or self.relay_error is not None) and not self._ended.done():
            self._ended.set_result(None)

    async def relay(self, handler, disconnected) -> bool:
        """Hand every event, from now on and those queued, to `handler(choice, Token or None at its end)` on the
        loop as it comes (no task wakes for it), until every choice has ended (True) or `disconnected()` (an async
        function) returns, the HTTP client gone (False: the requests are cancelled)."""
        self._relay, self._ended = handler, asyncio.get_running_loop().create_future()
        try:
            while not self.queue.empty():
                item = self.queue.get_nowait()
                if item is not _GONE:
                    self.put_nowait(item)
            if self.done or self.relay_error is not None:
                return True
            gone = asyncio.ensure_future(disconnected())
            try:
                await asyncio.wait({self._ended, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not self._ended.done():
                self.cancel()
                return False
            return True
        finally:  # (the handler, a closure over this generation, would hold it in a cycle: events after go queued)
            self._relay = None

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()

    def cancel(self) -> None:
        for handle, choice in zip(self.handles, self.choices):
            if choice.finish_reason is None and choice.error is None:
                handle.cancel()

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None or c.error is not None for c in self.choices)

    async def bunches(self, disconnected=None, poll: float = 0.5):
        """Yields lists of (choice, Token or None at its end): every event there is whenever one comes (at
        saturation a stream gets several at once, and sends them as one write), until every choice has ended.
        `disconnected`: an async callable, asked every `poll` seconds by a watcher (not at every token); when it
        says so the requests are cancelled and the iteration stops."""
        watcher = asyncio.create_task(self._watch(disconnected, poll)) if disconnected else None
        try:
            while not self.done:
                items = [await self.queue.get()]
                while not self.queue.empty():
                    items.append(self.queue.get_nowait())
                if _GONE in items:
                    self.cancel()
                    return
                yield [self._take(index, event) for index, event in items]
        finally:
            if watcher is not None:
                watcher.cancel()

    async def events(self, disconnected=None, poll: float = 0.5):
        """`bunches`, one event at a time."""
        async for bunch in self.bunches(disconnected, poll):
            for item in bunch:
                yield item

    async def _watch(self, disconnected, poll: float) -> None:
        while not self.done:
            await asyncio.sleep(poll)
            if await disconnected():
                self.queue.put_nowait(_GONE)
                return

    def _take(self, index: int, event) -> tuple[Choice, Token | None]:
        choice = self.choices[index]
        if isinstance(event, Finished):
            choice.finish_reason, choice.error = event.reason, event.error
            return choice, None
        self._last[index] = self.timing.token(self._last.get(index))
        choice.tokens.append(event)
        choice.text += event.text
        return choice, event

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    def prompt_tokens(self, distinct_prompts: int) -> int:
        """Each prompt counted once, however many choices it has (choices are laid out prompt by prompt)."""
        per_prompt = max(1, len(self.choices) // distinct_prompts)
        return sum(self.choices[i * per_prompt].prompt_tokens for i in range(distinct_prompts))
