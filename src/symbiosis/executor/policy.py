"""Batching policies: which queued calls the executor runs next, as one GEMM.

Queues are keyed by (layer id, op); forward and backward calls of a layer never share a GEMM. A policy
sees the queues, the time and the clients (attached; active = called within the last `ACTIVE_WINDOW`
seconds), and answers either a key to run now (all
calls queued at that key, concatenated along tokens) or how long to wait before asking again.

- `none`: every call runs alone, oldest first (inference before training).
- `lockstep`: a layer runs once every attached client has a call queued there (the paper's baseline), or
  when its oldest call has waited `max_wait` (a slow or dead client holds the others up no longer).
- `opportunistic`: inference runs at once, ahead of training; training waits for company up to a budget
  that shrinks as queued work grows: budget = max_wait * (1 - queued_tokens / target_tokens). No wait
  at all once every active client is queued (nobody else is coming soon) or a key holds target_tokens.
  An attached client that has been idle longer than ACTIVE_WINDOW (between requests, in a long optimizer
  step) makes nobody wait. And waiting stops while it does not pay: when fewer than half of the recent
  waits ended with another client's call in the batch, lone calls run at once, but for one in
  `probe_every`, which waits to find out whether it pays again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

QueueKey = tuple[str, str]  # (layer id, op)
ACTIVE_WINDOW = 0.05  # seconds since a client's last call during which it counts as active


@dataclass(frozen=True)
class ClientCounts:
    attached: int
    active: int


@dataclass
class QueuedCall:
    client_id: str
    tokens: int
    inference: bool
    arrived: float
    # False: waiting for company cannot pay (a pipelined client's call, posted before its input exists).
    may_wait: bool = True


@dataclass
class Queues:
    """What the policy sees: per key, the calls in arrival order."""

    by_key: dict[QueueKey, list[QueuedCall]] = field(default_factory=dict)

    def oldest(self, inference: bool | None = None, may_wait: bool | None = None) -> tuple[QueueKey, QueuedCall] | None:
        """The oldest call at the head of its key's queue that matches the filters given (None: any)."""
        best = None
        for key, calls in self.by_key.items():
            for call in calls:
                if (inference is None or call.inference == inference) and (may_wait is None or call.may_wait == may_wait):
                    if best is None or call.arrived < best[1].arrived:
                        best = (key, call)
                    break
        return best

    def clients(self) -> set[str]:
        return {c.client_id for calls in self.by_key.values() for c in calls}

    def tokens(self, key: QueueKey | None = None) -> int:
        keys = [key] if key is not None else list(self.by_key)
        return sum(c.tokens for k in keys for c in self.by_key.get(k, ()))


@dataclass(frozen=True)
class Decision:
    key: QueueKey | None = None
    only_inference: bool = False
    single: bool = False  # run the oldest call of `key` alone
    wait: float = 0.0


class Policy(Protocol):
    name: str

    def decide(self, queues: Queues, now: float, clients: ClientCounts) -> Decision: ...


@dataclass(frozen=True)
class NoBatching:
    name: str = "none"

    def decide(self, queues: Queues, now: float, clients: ClientCounts) -> Decision:
        key, _ = queues.oldest(inference=True) or queues.oldest()
        return Decision(key=key, single=True)


@dataclass(frozen=True)
class Lockstep:
    max_wait: float = 0.05
    name: str = "lockstep"

    def decide(self, queues: Queues, now: float, clients: ClientCounts) -> Decision:
        for key, calls in queues.by_key.items():
            if len({c.client_id for c in calls}) >= clients.attached:
                return Decision(key=key)
        key, oldest = queues.oldest()
        age = now - oldest.arrived
        return Decision(key=key) if age >= self.max_wait else Decision(wait=self.max_wait - age)


@dataclass
class Opportunistic:
    max_wait: float = 0.002
    target_tokens: int = 4096
    probe_every: int = 16
    """While waiting does not pay, one lone call in this many still waits, to notice when it pays again."""
    name: str = "opportunistic"
    # Share of recent waits that ended with another client's call in the batch (a moving average; it starts
    # optimistic). Clients whose steps drift apart rarely meet at one layer: waiting then only adds its
    # budget to every call (measured on an H100: ~1.3 ms a call for 1.05 calls per GEMM, docs/PERFORMANCE.md).
    company_rate: float = 1.0
    _waiting: set = field(default_factory=set)  # keys told to wait, whose outcome is not known yet
    _lone: int = 0  # lone calls run without waiting, since waiting stopped paying

    def decide(self, queues: Queues, now: float, clients: ClientCounts) -> Decision:
        inference = queues.oldest(inference=True)
        if inference is not None:
            return Decision(key=inference[0], only_inference=True)
        fullest = max(queues.by_key, key=lambda k: (queues.tokens(k), -queues.by_key[k][0].arrived))
        if len(queues.clients()) >= clients.active or queues.tokens(fullest) >= self.target_tokens:
            return self._run(queues, fullest)
        # A pipelined client posts its calls before their inputs exist and has queued its own work behind
        # each on its GPU; holding one on this CPU only delays its whole in-order chain, and company found
        # here would still wait for the later input on the GPU. It runs with whatever is queued at its key
        # (measured with four such clients: 0.23 ms of queue wait per call, 16.1k tokens/s against 21.3k
        # for `none`; docs/PERFORMANCE.md section 3).
        eager = queues.oldest(may_wait=False)
        if eager is not None:
            return self._run(queues, eager[0])
        key, oldest = queues.oldest()
        budget = self.max_wait * max(0.0, 1.0 - queues.tokens() / self.target_tokens)
        age = now - oldest.arrived
        if age >= budget:
            return self._run(queues, key)
        if key not in self._waiting and self.company_rate < COMPANY_WORTH_WAITING:
            self._lone += 1
            if self._lone % self.probe_every:
                return Decision(key=key)
        self._waiting.add(key)
        return Decision(wait=budget - age)

    def _run(self, queues: Queues, key: QueueKey) -> Decision:
        if key in self._waiting:  # a wait ends: did it find company?
            self._waiting.discard(key)
            company = len({c.client_id for c in queues.by_key[key]}) > 1
            self.company_rate += RATE_WEIGHT * (company - self.company_rate)
        return Decision(key=key)


COMPANY_WORTH_WAITING = 0.5  # wait for company while at least this share of waits finds it
RATE_WEIGHT = 0.25  # of the latest wait's outcome in company_rate: three lone waits in a row stop waiting


def make_policy(name: str, max_wait: float | None = None, target_tokens: int | None = None) -> Policy:
    """`none` | `lockstep` | `opportunistic`, with optional overrides of their knobs."""
    if name == "none":
        return NoBatching()
    if name == "lockstep":
        return Lockstep() if max_wait is None else Lockstep(max_wait=max_wait)
    if name == "opportunistic":
        knobs = {k: v for k, v in (("max_wait", max_wait), ("target_tokens", target_tokens)) if v is not None}
        return Opportunistic(**knobs)
    raise ValueError(f"unknown batching policy {name!r}: choose none, lockstep or opportunistic")
