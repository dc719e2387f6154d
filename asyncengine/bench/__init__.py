"""Benchmark maths: percentiles, per-request records -> run summary, the optimal cache hit."""

from __future__ import annotations

from asyncengine.bench.metrics import BenchSummary, RequestRecord, summarize
from asyncengine.bench.optimal_hit import OptimalHit, optimal_hit
from asyncengine.bench.percentiles import LatencyStats, percentile_of_sorted, percentiles

__all__ = [
    "BenchSummary",
    "LatencyStats",
    "OptimalHit",
    "RequestRecord",
    "optimal_hit",
    "percentile_of_sorted",
    "percentiles",
    "summarize",
]
