"""What the tenant's web page (`/ui`) plots: the tenant's adapters and their use, its recent request rate,
tokens and latencies (5-second buckets over the last 5 minutes), the engine's queues and KV cache, and the
executor's batching counters (the page turns successive readings into rates)."""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque

WINDOW_S, BUCKET_S, MAX_KEPT = 300, 5, 20000  # per tenant: at most MAX_KEPT finished requests remembered


class RecentRequests:
    def __init__(self):
        self._requests: dict[str, deque] = defaultdict(lambda: deque(maxlen=MAX_KEPT))
        self._lock = threading.Lock()

    def add(self, tenant: str, generation) -> None:
        timing = generation.timing
        end = timing.last_token or time.monotonic()
        ttft = None if timing.first_token is None else timing.first_token - timing.arrival
        with self._lock:
            self._requests[tenant].append((end, ttft, end - timing.arrival, generation.completion_tokens))

    def series(self, tenant: str) -> dict:
        """Per bucket, oldest first: requests finished, tokens made, median time to first token and end-to-end
        latency (null where no request finished)."""
        now = time.monotonic()
        buckets = WINDOW_S // BUCKET_S
        finished, tokens = [0] * buckets, [0] * buckets
        ttfts, latencies = [[] for _ in range(buckets)], [[] for _ in range(buckets)]
        with self._lock:
            recent = [r for r in self._requests.get(tenant, ()) if now - r[0] < WINDOW_S]
        for end, ttft, latency, count in recent:
            index = buckets - 1 - int((now - end) // BUCKET_S)
            finished[index] += 1
            tokens[index] += count
            latencies[index].append(latency)
            if ttft is not None:
                ttfts[index].append(ttft)
        median = lambda values: statistics.median(values) if values else None  # noqa: E731
        return {"bucket_s": BUCKET_S, "requests": finished, "tokens": tokens,
                "ttft_p50_s": [median(v) for v in ttfts], "e2e_p50_s": [median(v) for v in latencies]}


def snapshot(service, tenant: str) -> dict:
    usage = {row["model"]: row for row in service.state.usage(tenant)}
    adapters = [{"name": name, "loaded_at": loaded_at, "requests": usage.get(name, {}).get("requests", 0),
                 "completion_tokens": usage.get(name, {}).get("completion_tokens", 0)}
                for name, loaded_at in service.adapters.listed(tenant)]
    base = usage.get(service.base_name, {})
    overall = service.executor.stats_snapshot()["overall"]
    engine = service.engine
    return {
        "tenant": tenant, "base": {"name": service.base_name, "requests": base.get("requests", 0),
                                   "completion_tokens": base.get("completion_tokens", 0)},
        "adapters": adapters, "series": service.recent.series(tenant),
        "engine": {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                   "kv_cache_usage": 1.0 - engine.pool.free / engine.pool.num_blocks, "steps": engine.steps},
        "executor": {key: overall[key] for key in ("calls", "batches", "tokens", "queue_wait_s")},
        "time": time.time(),
    }
