"""Benchmark maths: percentiles, per-request records -> run summary, the optimal cache hit."""

from __future__ import annotations

from asyncengine.bench.optimal_hit import OptimalHit, optimal_hit
from asyncengine.bench.percentiles import LatencyStats, percentile_of_sorted, percentiles
from asyncengine.bench.records import BenchSummary, RequestRecord, summarize

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
