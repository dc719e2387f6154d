"""Prometheus metrics of one server: request outcomes and latency histograms recorded by the
server, and token counters and load gauges read from ``engine.stats()`` at scrape time. Each app
has its own registry, so several servers (tests) in one process never share the server's own
series.

Engine gauges: ``asyncengine_num_requests_running`` counts requests decoding,
``asyncengine_num_requests_prefilling`` those whose prompt is still being computed (one in chunked
prefill counts there until its last chunk), ``asyncengine_num_requests_waiting`` those not yet
admitted; a request is in exactly one of the three. ``asyncengine_retractions_total`` counts
running requests preempted for KV memory (each is recomputed later).

The token counters (prompt, generated, cache hit, cache miss) are the engine's cumulative
counts, so they include the tokens of requests aborted mid-way (a client that disconnects) and
of requests given to the engine directly; they restart from zero only with a new engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncengine.api.engine_client import EngineClient
from asyncengine.common.errors import EngineNotRunningError
from asyncengine.common.outputs import RequestMetrics
from asyncengine.server.scheduling_metrics import scheduling_families

# The *_created series (a timestamp per counter and histogram) only double the scrape size.
disable_created_metrics()

PREFIX = "asyncengine"

# outcome label of asyncengine_requests_total: finished (stop/length) | aborted (client gone,
# shutdown) | refused with a 4xx | refused with 503 (queue full) | failed (5xx or in-band error)
# | timed out before its first token (408)
OUTCOMES = ("success", "abort", "invalid", "overloaded", "error", "timeout")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# gauge name -> (engine.stats() key, help)
ENGINE_GAUGES: dict[str, tuple[str, str]] = {
    "num_requests_running": ("running", "Requests decoding (their prompt is computed)"),
    "num_requests_prefilling": (
        "prefilling",
        "Requests whose prompt is being computed (a chunked prefill counts until its last chunk)",
    ),
    "num_requests_waiting": ("waiting", "Requests waiting to be scheduled"),
    "kv_pages_total": ("pages_total", "KV pages in the pool"),
    "kv_pool_bytes": ("kv_pool_bytes", "Bytes of the KV pool (K and V of every layer)"),
    "kv_pages_free": ("pages_free", "KV pages free"),
    "kv_pages_used": ("pages_used", "KV pages held by live requests"),
    "kv_pages_cached": ("pages_cached", "KV pages owned by the radix prefix cache"),
    "kv_pages_evictable": ("pages_evictable", "Cached KV pages no live request locks"),
    "kv_pages_tail": ("pages_tail", "Partly filled KV pages of ended requests kept for reuse"),
    "kv_pages_pinned": ("pages_pinned", "Cached KV pages held by pinned prefixes"),
    "host_tier_pages": ("host_tier_pages", "Evicted KV pages the host tier holds (host_kv_tier)"),
    "spec_decode_acceptance_rate": (
        "spec_acceptance_rate",
        "Share of verified speculative guesses accepted (speculative decoding on)",
    ),
}


# counter name (without _total) -> (engine.stats() key, help)
ENGINE_COUNTERS: dict[str, tuple[str, str]] = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of requests the engine accepted"),
    "generation_tokens": ("generated_tokens", "Tokens generated (aborted requests included)"),
    # each request's prompt counted once, when first admitted (not again after a retraction)
    "cache_hit_tokens": ("hit_tokens", "Prompt tokens served from the prefix cache"),
    "cache_miss_tokens": ("miss_tokens", "Prompt tokens computed (not in the prefix cache)"),
    "retractions": (
        "retractions",
        "Running requests preempted because KV memory ran out (recomputed or swapped later)",
    ),
    "computed_tokens": ("computed_tokens", "Tokens the forwards computed (prefill + decode)"),
    "recomputed_tokens": (
        "recomputed_tokens",
        "Tokens computed again after their request was retracted (the recompute tax)",
    ),
    "swap_out_bytes": ("swapped_out_bytes", "KV bytes swapped out to the host buffer"),
    "swap_in_bytes": ("swapped_in_bytes", "KV bytes swapped back in from the host buffer"),
    "swap_seconds": (
        "swap_seconds",
        "Seconds spent copying KV to and from the host buffer (swapped KV and the host tier)",
    ),
    "host_tier_hit_tokens": (
        "host_hit_tokens",
        "Prompt tokens served from the host tier: copied back, not computed (host_kv_tier)",
    ),
    "host_tier_out_bytes": ("tier_out_bytes", "KV bytes of evicted pages copied to the host tier"),
    "host_tier_in_bytes": ("tier_in_bytes", "KV bytes copied back from the host tier"),
    "spec_decode_steps": ("spec_steps", "Steps that verified speculative guesses"),
    "spec_decode_num_draft_tokens": ("spec_verified_tokens", "Speculative guesses verified"),
    "spec_decode_num_accepted_tokens": ("spec_accepted_tokens", "Speculative guesses accepted"),
    "prompt_score_cache_hit_positions": (
        "prompt_score_hit_positions",
        "Scored prompt positions (prompt logprobs) taken from the prompt score cache",
    ),
}


class EngineStatsCollector(Collector):
    """Token counters and gauges read from ``engine.stats()`` when Prometheus scrapes."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except EngineNotRunningError:
            return
        for name, (key, doc) in ENGINE_COUNTERS.items():
            value = stats.get(key)
            if isinstance(value, (int, float)):
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        for name, (key, doc) in ENGINE_GAUGES.items():
            value = stats.get(key)
            if isinstance(value, (int, float)):
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        yield from scheduling_families(stats)

    def describe(self) -> Iterator[Metric]:
        # Describing without scraping keeps registration free of engine calls.
        return iter(())


class ServerMetrics:
    """The collectors of one HTTP server, in a registry of their own."""

    def __init__(self, engine: Any | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Generation requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between consecutive tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            f"{PREFIX}_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.connections_refused = Counter(
            f"{PREFIX}_connections_refused",
            "Connections answered 503 and closed unserved: max_open_connections were open",
            registry=r,
        )
        if engine is not None:
            r.register(EngineStatsCollector(engine))

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def observe_finished(self, metrics: RequestMetrics | None) -> None:
        """Record the timings of one request whose final output the server saw (stop, length,
        or an abort delivered in-band, e.g. at shutdown)."""
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        if metrics.queue_time is not None:
            self.queue_time.observe(metrics.queue_time)
        self.e2e.observe(metrics.e2e)
        for gap in metrics.itl:
            self.itl.observe(gap)

    def requests_served(self) -> float:
        """Generation requests answered so far, whatever their outcome."""
        samples = next(iter(self.requests.collect())).samples
        return sum(s.value for s in samples if s.name.endswith("_total"))

    def counter_value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (e.g. ``asyncengine_requests_total``); 0 when absent."""
        value = self.registry.get_sample_value(name, labels or {})
        return value or 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
