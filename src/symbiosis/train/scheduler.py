"""Which training work runs next: every adapter's requests in their order, and one pass for all of them.

Each adapter (a training model) has a queue of operations, run strictly in its `seq` order (a request whose
predecessor has not arrived waits for it). A round takes the next operation of every adapter: the optimizer steps
(all adapters' together: a few multi-tensor launches), then the calls (saves, loads: each its adapter's alone) one
after another, then the forward and forward_backward requests of all adapters run as one pass (`Trainer.launch`). A
pass holds at most `max_pass_tokens`; each waiting request gets an equal share of it (at least one datum), and a
request larger than its share goes on in the next rounds, where every other waiting request again gets its share.
So no adapter waits more than one pass for a turn, however large another adapter's batch: a small request finishes
in the first pass it joins.

A round starts as soon as anything is waiting (no fixed cycle), with one exception that keeps passes whole: the
adapters answered by the last round are expected back (a training loop answered its forward_backward sends its
optimizer step, then its next forward_backward). Were the next round to start with the first of them to arrive,
a loop of N clients would split into groups that take turns, each pass a fraction of the tenants: 2 datums a pass
of 4 tenants' loops, measured on a CPU. So a round waits for the expected adapters' next requests, until all
are there, or until none has come for `GATHER_QUIET_S` (the others are not on their way), and at most
`GATHER_FRACTION` of the last pass's time, never more than `max_gather_s`: a request that is waiting is delayed
by a bounded fraction of a pass, and an adapter that does not come back costs that once. Within a round, the
adapters whose optimizer step (or call) was just answered are waited for the same way, and their next
forward_backward joins the round's pass: a loop's step and its next pass can never be in one round's ready set,
so loops out of phase (half stepping while the other half passes) would otherwise stay split (SDK clients on a
CPU: 4.3 datums a pass of 8 tenants without, 5.5-6.0 with). An adapter that stops after a step costs the bound
twice, in its round and in the next. Clients in the process
come back within a millisecond or two; clients of the Tinker SDK over HTTP one after another over tens of
milliseconds, the service's event loop answering each and taking its next request.

A loop that sends its forward_backward and its optimizer step together and then waits for both answers
(tinker-cookbook's; `--loop together`) has its step queued by the time the pass is launched: the step is launched
right behind the pass and answered with the pass's answers (one group: one transaction of the service's), so that
the loop's next requests do not wait for a round of steps of their own.

Loops that send ahead (the next forward_backward queued before the step's answer: `--loop ahead` in
benchmarks/hosted_training.py) are not waited for: the round queues the steps, then the pass, and answers the steps
once the pass is on the device, so the host's answers overlap the GPU's pass and the steps cost no wait of their own
for the GPU. Where any stepped adapter's next request is not there yet, its loop waits for the answer: every step
is answered at once, as before.

On a GPU a pass runs after its launch returns (`Trainer.launch`), and a round may leave it in flight: where
clients are on their way back (answered by this round, or not back when its gather ended), the pass is answered
only once the next round has launched its own, behind it on the device. Lock-step clients whose round trip is long
beside a pass (32 Tinker SDK loops over HTTP: ~40 ms through the service's one event loop, against a 130 ms pass of
all 32) are split in two halves that way: once two whole gathers in a row have kept the device idle a tenth of a
pass (`SPLIT_AT`) and a pass keeps the device busy after its launch (so smaller passes cost the device, not the
host, their share), the next gather launches its pass when half the expected adapters are back. The device runs
one half's pass while the other half's answers make their round trip, and the halves stay apart, each waited for
while the other's pass runs, until both come back at once (`UNSPLIT_AT`). Loops that come back at once (clients in
the process, loops that send ahead) keep one pass for all; so does a host-bound pass (one tenant's). An adapter in
flight runs nothing else until its pass is answered. H100, 32 SDK loops: 0.75x -> 0.88-1.03x the in-process
loops' tokens/s (docs/PERFORMANCE.md section 10).

A pass that fails (out of memory, say) fails the requests in it, and the gradients their adapters gathered since
their last optimizer step are dropped (`Operation.fail` says so): a later optimizer step must not apply half a
pass.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager

from symbiosis.train.lora import AdamParams, HostedLora, launch_steps
from symbiosis.train.trainer import InFlight, Result, Trainer, Work
from symbiosis.worker import Worker

log = logging.getLogger("symbiosis.train")
UNORDERED = ""  # the queue of calls that belong to no adapter (submit_call); adapter keys are never empty
GATHER_FRACTION = 0.5  # a round waits for the adapters the last one answered at most this much of the last pass
GATHER_QUIET_S = 0.02  # ... and no longer than this after the last of them came
SPLIT_AT = 0.1  # a gather with the device idle this much of a pass or more: the next ones launch half (see _gather)
UNSPLIT_AT = 0.05  # ... until half of them come back within this much of the two halves' passes: one pass again
POLL_S = 0.001  # how often a gather beside a pass in flight looks whether the device has finished it


def _nothing() -> None:
    pass


def _raise(error: Exception):
    raise error


@dataclass
class Operation:
    """One request of one adapter: a pass (`work`), an optimizer step (`step`: its result is `call(metrics)`), or
    a call (`call()` returns the result)."""
    seq: int
    done: Callable[[object], None]  # receives the result
    fail: Callable[[Exception], None]  # receives the error
    work: Work | None = None
    call: Callable[..., object] | None = None
    step: tuple[HostedLora, AdamParams] | None = None
    # called (on the runner's thread, with no lock held) when the operation is its adapter's next and is about to
    # run, before its kind is read: sets what `work` or `step` train (serve/tinker binds a request to its model's
    # state only then, so that one waiting for an earlier seq holds nothing); an error fails this operation alone
    bind: Callable[["Operation"], None] | None = None
    results: list[Result] = field(default_factory=list)  # a pass's parts so far
    next_datum: int = 0


@dataclass
class _Flight:
    """A pass launched on the device and not yet answered: its operations' parts (`_launch`), the pass's results to
    come (None: its launch failed with `error`), the optimizer steps queued right behind it (`_waited_steps`) and
    the call that answers them."""
    parts: list[tuple[str, Operation, Work]]
    pending: InFlight | None
    error: Exception | None
    steps: dict[str, Operation]
    answer_steps: Callable[[], None]
    began: float

    @property
    def keys(self) -> set[str]:
        return {key for key, _, _ in self.parts} | set(self.steps)


class TrainingQueue:
    def __init__(self, trainer: Trainer, max_pass_tokens: int = 16384, max_gather_s: float = 0.2,
                 gather_fraction: float | None = None,
                 answering: Callable[[], ContextManager] = contextlib.nullcontext):
        """`answering`: a context each group of a round's answers (its steps', its pass's) is given in (the
        service's `StateStore.batch`: their writes one transaction)."""
        if max_pass_tokens < 1:
            raise ValueError("max_pass_tokens must be positive")
        if not max_gather_s >= 0:
            raise ValueError("max_gather_s must be at least 0")
        if gather_fraction is not None and not gather_fraction >= 0:
            raise ValueError("gather_fraction must be at least 0")
        self.trainer, self.max_pass_tokens, self.max_gather_s = trainer, max_pass_tokens, max_gather_s
        self.gather_fraction = gather_fraction  # None: GATHER_FRACTION
        self.answering = answering
        self._queues: dict[str, dict[int, Operation]] = {}  # adapter key -> seq -> operation
        self._next: dict[str, int] = {}  # adapter key -> the seq that runs next
        self._unordered = 0
        self._worker = Worker("symbiosis-training", lambda: bool(self._ready()) or self._flight is not None,
                              self.round)
        self._lock = self._worker.lock
        self._expected: set[str] = set()  # adapters the last round answered: their next requests are awaited
        # while a gather waits: the expected adapters not yet ready (a submission wakes it only when it readies the
        # last of them: 64 wake-ups a round of 32 loops took the interpreter from the HTTP thread that was
        # reading their requests), and when the last operation came (for its quiet bound)
        self._missing: set[str] | None = None
        self._wake_at = 0  # ... how few of them may be missing when it goes on (half, where it splits)
        self._last_arrival = 0.0
        self._answered: set[str] = set()  # adapters this round answered
        self._last_pass_s = 0.0
        self._last_made = 0.0  # when the last pass's results were made (a pass in flight behind it began then)
        self._flight: _Flight | None = None  # a pass on the device whose answers wait for the next pass's launch
        self._flying: set[str] = set()  # its adapters: nothing of theirs runs until it is answered
        self._carried: set[str] = set()  # expected adapters the last gather went on without (awaited once more)
        # whether passes launch once half the expected adapters are back (`_gather`), whether the last pass alone
        # kept the device busy after its launch at least half its time, and when the last pass was answered
        self._splitting = False
        self._idle_gathers = 0  # whole gathers in a row that kept the device idle SPLIT_AT of a pass or more
        self._device_bound = False
        self._answered_at = 0.0
        self._round_trips: collections.deque[float] = collections.deque(maxlen=2)  # the halves' last, while split
        self.passes = 0
        self.overlapped = 0  # passes kept in flight while the next one was gathered and launched
        # seconds the runner spent waiting for expected adapters, on optimizer steps and calls, and on passes:
        # where a round's time goes (the benchmarks read it; a monotonic count, as Prometheus's counters)
        self.seconds = {"gather": 0.0, "steps": 0.0, "pass": 0.0}

    def open(self, key: str, next_seq: int) -> None:
        """An adapter whose first (next) operation will have `next_seq`."""
        with self._lock:
            self._queues.setdefault(key, {})
            self._next[key] = next_seq

    def close(self, key: str) -> None:
        with self._lock:
            for operation in self._queues.pop(key, {}).values():
                operation.fail(RuntimeError("the training model was removed"))
            self._next.pop(key, None)

    def submit(self, key: str, operation: Operation) -> None:
        with self._lock:
            if key not in self._queues:
                raise KeyError(key)
            self._queues[key][operation.seq] = operation
            self._last_arrival = time.monotonic()
            if self._missing is None:  # the runner is not gathering: wake it if it waits for work
                self._lock.notify()
            elif key in self._missing and operation.seq == self._next[key]:
                self._missing.discard(key)
                if len(self._missing) <= self._wake_at:
                    self._lock.notify()

    def submit_call(self, call: Callable[[], object], done: Callable[[object], None],
                    fail: Callable[[Exception], None]) -> None:
        """A call that belongs to no adapter's order (a sampler's prompt log-probabilities): it runs in the next
        round."""
        with self._lock:
            self._unordered += 1
            self._queues.setdefault(UNORDERED, {})[self._unordered] = Operation(self._unordered, done, fail, call=call)
            self._next.setdefault(UNORDERED, self._unordered)
            self._lock.notify()

    def next_seq(self, key: str) -> int | None:
        """The seq of the operation the adapter's queue waits for next (None: no such adapter)."""
        with self._lock:
            return self._next.get(key)

    def waiting(self) -> set[str]:
        """The adapters that have operations queued (running or waiting for an earlier seq)."""
        with self._lock:
            return {key for key, queue in self._queues.items() if queue and key != UNORDERED}

    def skip(self, key: str, seq: int) -> None:
        """`seq` will never come (it was answered otherwise): the adapter's queue goes on past it."""
        with self._lock:
            if self._next.get(key) == seq:
                self._advance(key)
                self._lock.notify()

    # -- the runner --

    def start(self) -> "TrainingQueue":
        self._worker.start()
        return self

    def stop(self) -> None:
        self._worker.stop()
        if self._flight is not None:  # answered before the queue stops
            self._land(self._flight)
            self._flight = None

    def _ready(self) -> dict[str, Operation]:
        return {key: queue[self._next[key]] for key, queue in self._queues.items()
                if self._next[key] in queue and key not in self._flying}

    def _advance(self, key: str) -> None:
        self._queues[key].pop(self._next[key], None)
        self._next[key] += 1

    def _gather(self, expected: set[str], may_split: bool = True) -> tuple[dict[str, Operation], set[str]]:
        """The ready operations once the `expected` adapters are back, and those of them still on their way (to be
        awaited by the next round too).

        With a pass in flight the device is busy: the gather waits for all of them until the device has finished
        that pass. With the device idle it waits for all of them until the bound (GATHER_FRACTION of the last pass,
        GATHER_QUIET_S after the last arrival, max_gather_s), those not back by then no longer expected; or, while
        splitting, until half of them are back: their pass runs while the others come back, and the others' pass
        while the first half's answers make their round trip (round() keeps the first pass in flight until the
        second is launched).

        Splitting starts when two whole gathers in a row kept the device idle SPLIT_AT of a pass or more (one such
        gather may be a pause of the clients', the collector's) and a pass alone keeps the device busy after its
        launch (clients whose round trip is long: 32 Tinker SDK loops over HTTP took ~40 ms to come back to a 130
        ms pass; not one tenant's pass, which is the host's). It stops when both halves come back within
        UNSPLIT_AT of the two halves' passes (loops that send ahead are back at once) or a whole gather is short:
        round() then answers the pass in flight before it gathers, and one pass holds everybody again."""
        with self._lock:
            now = began = time.monotonic()
            flight = self._flight
            fraction = GATHER_FRACTION if self.gather_fraction is None else self.gather_fraction
            deadline = now + min(self.max_gather_s, fraction * self._last_pass_s)
            live = {key for key in expected if key in self._queues and key not in self._flying}
            split = flight is None and may_split and self._splitting
            wake_at = len(live) // 2 if split else 0  # how few may be missing when the gather goes on
            carried, whole = set(), True
            while True:
                ready = self._ready()
                missing = {key for key in live if key not in ready}
                if not missing or self._worker.stopping:  # (stop() wakes it: no wait at shutdown)
                    if flight is not None and live:  # a half back: its round trip, and the other half's before
                        self._round_trips.append(now - self._answered_at)
                        if max(self._round_trips) < UNSPLIT_AT * 2 * self._last_pass_s:
                            self._splitting = False
                    break
                if flight is not None:
                    if flight.pending is None or flight.pending.done():
                        carried = missing - self._carried  # (awaited by one more round at most)
                        break
                    wait = POLL_S
                else:
                    if len(missing) <= wake_at:
                        carried, whole = missing - self._carried, False
                        break
                    wait = min(deadline, max(began, self._last_arrival) + GATHER_QUIET_S) - now
                    if wait <= 0:
                        break
                self._missing, self._wake_at = missing, wake_at
                self._lock.wait(wait)
                now = time.monotonic()
            self._missing = None
            waited = time.monotonic() - began
            self.seconds["gather"] += waited
            if flight is None and whole and live and may_split:
                idle = self.trainer.overlaps and self._device_bound and waited >= SPLIT_AT * self._last_pass_s
                self._idle_gathers = self._idle_gathers + 1 if idle else 0
                self._splitting = self._idle_gathers >= 2
            return ready, carried  # (round() sets what the next round expects)

    def round(self) -> bool:
        """Run what is ready: the optimizer steps, the calls, then one pass. Returns whether anything ran.

        While the gathers split (`_gather`) and adapters are on their way back (answered by this round, or not back
        when the gather ended), the pass is kept in flight: its answers are given once the next round has launched
        its pass, so that the device runs one while the other's clients make their round trip."""
        older, landed = self._flight, self._flight is not None
        if older is not None and not self._splitting:  # one pass for all again: its clients are awaited too
            self._land(older)
            self._flight = older = None
        ready, carried = self._gather(self._expected | self._answered)
        ready = self._bound(ready)
        steps = {key: op for key, op in ready.items() if op.step is not None}
        calls = {key: op for key, op in ready.items() if op.work is None and op.step is None}
        passes = {key: op for key, op in ready.items() if op.work is not None}
        started = time.monotonic()
        answer_steps = self._launch_steps(steps) if steps else _nothing
        for key, op in calls.items():
            self._answer(key, op, op.call)
        if not self._next_queued(set(steps)):  # a loop that waits for its step's answer before its next request
            answer_steps()
        self.seconds["steps"] += time.monotonic() - started
        if steps or calls:  # their adapters' next forward_backward joins this pass (`_rejoin`)
            passes.update(self._rejoin(set(steps) | set(calls) - {UNORDERED}, set(passes)))
        flight = self._launch(passes) if passes else None
        started = time.monotonic()
        answer_steps()  # (once the pass is queued: the device runs it while the host answers)
        self.seconds["steps"] += time.monotonic() - started
        self._flight = None
        if older is not None:
            self._land(older)
        if flight is not None:
            if self._splitting and (self._answered | carried) - flight.keys:
                self._flight = flight
                self.overlapped += 1
            else:
                self._land(flight, alone=True)
        with self._lock:
            self._expected, self._answered = (self._answered | carried) - self._flying, set()
            self._carried = carried
        return bool(ready) or landed

    def _next_queued(self, keys: set[str]) -> bool:
        """Whether each of these adapters' next request is queued already (its loop sends ahead of the answers)."""
        with self._lock:
            ready = self._ready()
            return all(key in ready for key in keys)

    def _rejoin(self, answered: set[str], passing: set[str]) -> dict[str, Operation]:
        """The pass requests of `answered` adapters (their step or call just answered) that come within the
        gather's bound, and any other adapter's that came meanwhile. A loop's optimizer step and its next
        forward_backward can never be in one round's ready set (one operation an adapter a round); without this,
        loops whose steps and passes fell out of phase would stay split for good, half of them stepping while the
        other half passes."""
        more, _ = self._gather(answered, may_split=False)
        return {key: op for key, op in self._bound(more).items() if op.work is not None and key not in passing}

    def _bound(self, ready: dict[str, Operation], queued_next: bool = True) -> dict[str, Operation]:
        """`ready` with each operation's `bind` called (once it succeeds); one whose bind failed is answered with
        its error where it is its adapter's next (`queued_next`), else left out, to fail when it is."""
        bound = {}
        for key, op in ready.items():
            if op.bind is not None:
                try:
                    op.bind(op)
                except Exception as e:  # noqa: BLE001 -- this request fails; the others go on
                    if queued_next:
                        op.bind = None
                        self._finish(key, op, error=e)
                    continue
                op.bind = None
            bound[key] = op
        return bound

    def _launch_steps(self, operations: dict[str, Operation], release: bool = True) -> Callable[[], None]:
        """Every adapter's optimizer step of the round queued on the device together (`launch_steps`: a few launches
        for all). Their queues move on at once (what runs after sees the stepped states; `release` False: the
        steps queued behind a pass in flight, whose queues move on when it is answered); the returned call answers
        them (once), reading their metrics: at once where a loop waits for the answer before its next request,
        otherwise when the round's pass is queued, so that the GPU runs the pass while the host answers the steps
        (an answer may write the adapter's state: serve/tinker)."""
        try:
            read_metrics = launch_steps([op.step for op in operations.values()])
        except Exception as e:  # noqa: BLE001 -- these steps fail (when answered); the other requests go on
            read_metrics = functools.partial(_raise, e)
        if release:
            for key, op in operations.items():
                self._release(key, op)
        answered = []

        def answer() -> None:
            if answered:
                return
            answered.append(True)
            try:
                metrics = read_metrics()
            except Exception as e:  # noqa: BLE001 -- these steps fail; the other requests go on
                for key, op in operations.items():
                    self._finish(key, op, error=e)
                return
            with self.answering():
                for (key, op), step_metrics in zip(operations.items(), metrics):
                    self._answer(key, op, lambda: op.call(step_metrics))

        return answer

    def _answer(self, key: str, op: Operation, compute: Callable[[], object]) -> None:
        """Finish `op` with what `compute` returns, or with its error (which fails this request alone)."""
        try:
            result = compute()
        except Exception as e:  # noqa: BLE001 -- this request fails; the others go on
            self._finish(key, op, error=e)
        else:
            self._finish(key, op, result=result)

    def _launch(self, operations: dict[str, Operation]) -> _Flight:
        """One pass of the operations' next datums (each its share of `max_pass_tokens`) queued on the device, and
        behind it the optimizer steps of the loops that wait for both answers (`_waited_steps`)."""
        began = time.monotonic()
        share = max(1, self.max_pass_tokens // len(operations))
        # A pass pads every datum to its longest (trainer.py): what it costs is rows x that length, not the tokens.
        # The longest is that of the operations' first datums (each takes at least its first); an operation stops at
        # a longer datum (the first of its next pass) and at its share of padded rows. (Counting tokens alone, one
        # 120-token datum beside 2,000 one-token ones made a 240,000-token pass of 15 GB.)
        longest = max((len(op.work.datums[op.next_datum].tokens) for op in operations.values()
                       if op.next_datum < len(op.work.datums)), default=1)
        parts = []
        for key, op in operations.items():
            datums = []
            for datum in op.work.datums[op.next_datum:]:
                if datums and ((len(datums) + 1) * longest > share or len(datum.tokens) > longest):
                    break
                datums.append(datum)
            parts.append((key, op, Work(op.work.lora, datums, op.work.loss_fn, op.work.config, op.work.backward)))
        try:
            pending = self.trainer.launch([work for _, _, work in parts])
        except Exception as e:  # noqa: BLE001 -- the pass's requests fail (`_land`); the others go on
            log.exception("a training pass failed")
            flight = _Flight(parts, None, e, {}, _nothing, began)
        else:
            steps = self._bound(self._waited_steps(parts), queued_next=False)  # (each behind its pass)
            flight = _Flight(parts, pending, None, steps, self._launch_steps(steps, release=False) if steps
                             else _nothing, began)
        with self._lock:
            self._flying |= flight.keys
        self.seconds["pass"] += time.monotonic() - began
        return flight

    def _land(self, flight: _Flight, alone: bool = False) -> None:
        """Answer a launched pass (and the steps behind it) once the device has made its results; `alone`: it was
        launched just now, nothing behind it: how long it kept the device busy after its launch says whether the
        device (not the host) bounds passes (`_gather`'s split)."""
        began = time.monotonic()
        results, error = None, flight.error
        if flight.pending is not None:
            try:
                results = flight.pending.results()
            except Exception as e:  # noqa: BLE001 -- the pass's requests fail; their adapters drop their gradients
                log.exception("a training pass failed")
                error = e
        made = time.monotonic()
        with self.answering():
            if error is not None:
                failure = RuntimeError(f"the training pass failed ({type(error).__name__}: {error}); the gradients "
                                       "this model gathered since its last optimizer step were dropped")
                for key, op, work in flight.parts:
                    if op.work.backward:
                        work.lora.drop_gradients()
                    self._finish(key, op, error=failure)
                for key, op in flight.steps.items():
                    self._finish(key, op, error=failure)
            else:
                self.passes += 1
                pass_s = made - max(flight.began, self._last_made)
                self._last_pass_s, self._last_made = pass_s, made
                if alone:
                    self._device_bound = made - began >= pass_s / 2
                for (key, op, work), result in zip(flight.parts, results):
                    op.results.append(result)
                    op.next_datum += len(work.datums)
                    if op.next_datum == len(op.work.datums):
                        self._finish(key, op, result=Result([lp for r in op.results for lp in r.logprobs],
                                                            [loss for r in op.results for loss in r.losses]))
                flight.answer_steps()  # answered with the pass, in its group
        with self._lock:
            self._flying -= flight.keys
        self._answered_at = time.monotonic()
        self.seconds["pass"] += time.monotonic() - began

    def _waited_steps(self, parts: list[tuple[str, Operation, Work]]) -> dict[str, Operation]:
        """The optimizer steps queued right behind the requests this pass finishes, of loops that wait for their
        answers (nothing queued behind the step: tinker-cookbook's loop sends forward_backward and optim_step, then
        waits for both). Launched behind the pass, they are answered with it: the loop's next requests come a
        round's steps earlier, and a pass launched after them does not hold up their answers (the steps of loops
        that send ahead are left to the next round, answered while its pass runs)."""
        found = {}
        with self._lock:
            for key, op, work in parts:
                queue = self._queues.get(key, {})
                step = queue.get(op.seq + 1)
                if op.next_datum + len(work.datums) == len(op.work.datums) and step is not None \
                        and step.step is not None and op.seq + 2 not in queue:
                    found[key] = step
        return found

    def _release(self, key: str, op: Operation) -> None:
        """`op` is over for its adapter's queue, which goes on past it; the adapter was answered this round."""
        with self._lock:
            if self._queues.get(key, {}).get(op.seq) is op:
                self._advance(key)
            if key != UNORDERED:
                self._answered.add(key)

    def _finish(self, key: str, op: Operation, result=None, error: Exception | None = None) -> None:
        self._release(key, op)
        try:
            if error is not None:
                op.fail(error)
            else:
                op.done(result)
        except Exception as e:  # noqa: BLE001 -- the answer could not be kept: this request fails, the thread goes on
            log.exception("answering a %s request failed", "failed" if error is not None else "finished")
            if error is None:
                try:
                    op.fail(e)
                except Exception:  # noqa: BLE001
                    log.exception("failing that request failed too")
