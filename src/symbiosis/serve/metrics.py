"""Prometheus metrics (prometheus_client, a registry of the service's own), with vLLM's names under the
`symbiosis:` prefix where vLLM has one. Served at `/metrics` to the admin tenant.

Engine state (running / waiting requests, KV cache use, the adapter tiers) and the executor's batching (calls, batches, tokens,
queue wait: the split tenants' calls) are read when scraped; request figures are observed as requests end."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _Live:
    """Read on each scrape: the engine's queues and KV pool, the executor's batching."""

    def __init__(self, engine, executor):
        self.engine, self.executor = engine, executor

    def collect(self):
        scheduler, pool = self.engine.scheduler, self.engine.pool
        yield GaugeMetricFamily("symbiosis:num_requests_running", "Requests in the engine's running batch.",
                                value=len(scheduler.running))
        yield GaugeMetricFamily("symbiosis:num_requests_waiting", "Requests waiting to join the engine's batch.",
                                value=len(scheduler.waiting))
        yield GaugeMetricFamily("symbiosis:kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0-1).",
                                value=1.0 - pool.free / pool.num_blocks)
        tiers = self.engine.adapters.tiers()
        yield GaugeMetricFamily("symbiosis:adapter_slots_used", "Device adapter slots holding an adapter.",
                                value=tiers["device"]["used"])
        yield GaugeMetricFamily("symbiosis:adapter_host_bytes", "Bytes of adapters held in host memory.",
                                value=tiers["host"]["bytes"])
        lookups = CounterMetricFamily("symbiosis:adapter_lookups", "Where requests' adapters were found.",
                                      labels=["tier"])
        for tier, key in (("device", "device_hits"), ("host", "host_hits"), ("disk", "disk_reads")):
            lookups.add_metric([tier], tiers[key])
        yield lookups
        overall = self.executor.stats_snapshot()["overall"]
        for name, key, text in (("executor_calls", "calls", "Layer calls the executor ran (split tenants)."),
                                ("executor_batches", "batches", "Batched GEMMs those calls made."),
                                ("executor_tokens", "tokens", "Tokens through the executor's layers.")):
            yield CounterMetricFamily(f"symbiosis:{name}", text, value=overall[key])
        yield CounterMetricFamily("symbiosis:executor_queue_wait_seconds", "Time calls waited to be batched.",
                                  value=overall["queue_wait_s"])
        yield GaugeMetricFamily("symbiosis:executor_mean_batch_calls", "Calls per executor batch, on average.",
                                value=overall["mean_batch_calls"])


class Metrics:
    def __init__(self, engine, executor):
        self.registry = CollectorRegistry()
        self.registry.register(_Live(engine, executor))
        labels = ("tenant", "model")
        self.requests = Counter("symbiosis:request_success", "Finished requests by finish reason.",
                                labels + ("finished_reason",), registry=self.registry)
        self.failures = Counter("symbiosis:request_failure", "Requests refused or failed, by HTTP status.",
                                ("tenant", "status"), registry=self.registry)
        self.prompt_tokens = Counter("symbiosis:prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("symbiosis:generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry)
        self.ttft = Histogram("symbiosis:time_to_first_token_seconds", "From arrival to the first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("symbiosis:inter_token_latency_seconds", "Between consecutive tokens of a request.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("symbiosis:e2e_request_latency_seconds", "From arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.hmi_batch = Histogram("symbiosis:hmi_generation_batch_size", "HMI generations run as one batch.",
                                   buckets=(1, 2, 4, 8, 16, 32), registry=self.registry)

    def finished(self, tenant: str, model: str, generation, prompt_tokens: int) -> None:
        """`prompt_tokens`: each prompt once, however many choices it had (as usage counts them)."""
        timing = generation.timing
        for choice in generation.choices:
            if choice.finish_reason is not None:
                self.requests.labels(tenant, model, choice.finish_reason).inc()
        self.prompt_tokens.labels(tenant, model).inc(prompt_tokens)
        self.generation_tokens.labels(tenant, model).inc(generation.completion_tokens)
        if timing.first_token is not None:
            self.ttft.observe(timing.first_token - timing.arrival)
            self.e2e.observe(timing.last_token - timing.arrival)
        for gap in timing.gaps:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
