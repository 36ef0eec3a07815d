"""What the executor did, per (layer, op) and overall: calls, batch sizes, queue wait, compute time; and how
busy each of its threads was (the share of wall time a thread spent handling work rather than waiting for
it, which tells an executor-bound fleet from a client-bound one)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch


@dataclass
class LayerStats:
    calls: int = 0
    batches: int = 0
    tokens: int = 0
    max_batch_calls: int = 0
    max_batch_tokens: int = 0
    queue_wait_s: float = 0.0
    max_queue_wait_s: float = 0.0
    compute_s: float = 0.0

    def add(self, other: "LayerStats") -> None:
        for name, value in asdict(other).items():
            merged = max(getattr(self, name), value) if name.startswith("max_") else getattr(self, name) + value
            setattr(self, name, merged)

    def summary(self) -> dict:
        out = asdict(self)
        out["mean_batch_calls"] = self.calls / self.batches if self.batches else 0.0
        out["mean_batch_tokens"] = self.tokens / self.batches if self.batches else 0.0
        out["mean_queue_wait_ms"] = 1e3 * self.queue_wait_s / self.calls if self.calls else 0.0
        return out


CUDA_TIMING_EVERY = 16  # time 1 batch in 16 with CUDA events: recording events costs ~10 us per batch


class ExecutorStats:
    """Thread-safe counters. On CUDA, compute time is measured with events on one batch in
    CUDA_TIMING_EVERY per (layer, op) and scaled up; events are resolved when stats are read, so recording
    never synchronises the device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.by_key: dict[tuple[str, str], LayerStats] = defaultdict(LayerStats)
        self._timed_batches = 0
        self._pending_events: list[tuple[tuple[str, str], torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()
        self.started = time.time()
        self.busy_s: dict[str, float] = defaultdict(float)  # thread role ("io", "batcher") -> seconds working
        self.by_client: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # attached client -> [calls, tokens]

    def add_busy(self, role: str, seconds: float) -> None:
        """Each role has one thread, the only writer of its entry: no lock needed."""
        self.busy_s[role] += seconds

    def timer(self):
        """Start timing one batch; returns a token for `record` (None: this batch is not timed)."""
        if self.cuda:
            self._timed_batches += 1
            if self._timed_batches % CUDA_TIMING_EVERY:
                return None
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            return start
        return time.perf_counter()

    def count_client(self, client_id: str, tokens: int) -> None:
        with self._lock:
            figures = self.by_client[client_id]
            figures[0] += 1
            figures[1] += tokens

    def forget(self, client_id: str) -> None:
        with self._lock:
            self.by_client.pop(client_id, None)

    def count_direct(self, key: tuple[str, str], tokens: int, client_id: str) -> None:
        """A call an in-process client ran itself on the executor's weights: a batch of one (counted, not
        timed; clients on several threads may count at once)."""
        self.count_client(client_id, tokens)
        with self._lock:
            s = self.by_key[key]
            s.calls += 1
            s.batches += 1
            s.tokens += tokens
            s.max_batch_calls = max(s.max_batch_calls, 1)
            s.max_batch_tokens = max(s.max_batch_tokens, tokens)

    def record(self, key: tuple[str, str], waits: list[float], tokens: int, started) -> None:
        with self._lock:
            s = self.by_key[key]
            s.calls += len(waits)
            s.batches += 1
            s.tokens += tokens
            s.max_batch_calls = max(s.max_batch_calls, len(waits))
            s.max_batch_tokens = max(s.max_batch_tokens, tokens)
            s.queue_wait_s += sum(waits)
            s.max_queue_wait_s = max(s.max_queue_wait_s, max(waits))
            if self.cuda:
                if started is not None:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(self.stream)
                    self._pending_events.append((key, started, end))
            else:
                s.compute_s += time.perf_counter() - started

    def snapshot(self, clients: dict[str, str], only: set[str] | None = None) -> dict:
        """Every figure; or, for a tenant (`only`: its clients), its clients' own calls and tokens alone: the
        per-layer and overall figures tell what other tenants do."""
        if only is not None:
            with self._lock:
                own = {c: {"calls": self.by_client[c][0], "tokens": self.by_client[c][1]}
                       for c in sorted(only) if c in clients}
            return {"uptime_s": time.time() - self.started, "attached_clients": sorted(own), "per_client": own}
        with self._lock:
            if self._pending_events:
                self._pending_events[-1][2].synchronize()
                for key, start, end in self._pending_events:
                    self.by_key[key].compute_s += CUDA_TIMING_EVERY * start.elapsed_time(end) / 1e3
                self._pending_events.clear()
            total = LayerStats()
            per_layer = {}
            for (layer_id, op), s in sorted(self.by_key.items()):
                total.add(s)
                per_layer[f"{layer_id}:{op}"] = s.summary()
            per_client = {c: {"calls": self.by_client[c][0], "tokens": self.by_client[c][1]} for c in sorted(clients)}
        return {"uptime_s": time.time() - self.started, "attached_clients": sorted(clients),
                "busy_s": dict(self.busy_s), "overall": total.summary(), "per_layer": per_layer,
                "per_client": per_client}
