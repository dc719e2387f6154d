"""Per-request timing records and the summary every run reports (real engine or simulator)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from asyncengine.bench.percentiles import LatencyStats


@dataclass(slots=True)
class RequestRecord:
    """What one request went through, times in seconds on one clock.

    ``token_times`` holds the time each output token reached the caller, the first included.
    A request that failed (or was aborted) has ``failed=True``, one that ran out of time
    ``timed_out=True``; neither counts in any latency. ``blocked``: steps waited by admission
    block reason (asyncengine/scheduler/admission.py).
    """

    rid: str
    arrival_time: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    cached_tokens: int = 0
    failed: bool = False
    retracts: int = 0
    timed_out: bool = False
    tenant: str | None = None
    priority: int = 0
    blocked: dict[str, int] = field(default_factory=dict)
    lora: str | None = None  # the LoRA adapter it ran under (None: the base model)
    queue_time: float | None = None  # arrival to first scheduled (None: never scheduled)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def completed(self) -> bool:
        return not self.failed and not self.timed_out and self.finish_time is not None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass(slots=True)
class BenchSummary:
    num_requests: int
    num_completed: int
    num_failed: int
    retracts: int
    num_timed_out: int
    duration: float  # first arrival to last finish, seconds
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    # of every request, ended or not: a request that timed out after its prefill left its
    # pages to the others, so the hit rate is over the whole workload, like its offline bound
    prompt_tokens: int
    output_tokens: int  # of completed requests
    cached_tokens: int
    cache_hit_rate: float  # cached / prompt tokens
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats  # every gap between consecutive tokens of every request, pooled
    e2e: LatencyStats

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def inter_token_gaps(token_times: Sequence[Sequence[float]]) -> np.ndarray:
    """Every request's gaps between consecutive tokens, request after request: one diff over
    all the times joined, less the gaps that would span two requests."""
    lengths = np.fromiter(map(len, token_times), dtype=np.int64, count=len(token_times))
    if not lengths.size:
        return np.empty(0)
    joined = np.fromiter(
        itertools.chain.from_iterable(token_times), dtype=float, count=int(lengths.sum())
    )
    gaps = np.diff(joined)
    # the gap from a request's last token to the next request's first is no gap of either
    across = np.cumsum(lengths)[:-1] - 1
    keep = np.ones(gaps.size, dtype=bool)
    keep[across[(across >= 0) & (across < gaps.size)]] = False
    return gaps[keep]


def summarize(records: Sequence[RequestRecord], *, retracts: int | None = None) -> BenchSummary:
    """Summarize a run. ``retracts`` overrides the per-request sum (when the engine counts them)."""
    done = [r for r in records if r.completed]
    finishes = [r.finish_time for r in records if r.finish_time is not None]
    start = min((r.arrival_time for r in records), default=0.0)
    duration = max(finishes) - start if finishes else 0.0
    prompt_tokens = sum(r.prompt_tokens for r in records)
    output_tokens = sum(r.output_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in records)
    gaps = inter_token_gaps([r.token_times for r in done])

    def rate(amount: float) -> float:
        return amount / duration if duration > 0 else math.nan

    return BenchSummary(
        num_requests=len(records),
        num_completed=len(done),
        num_failed=sum(r.failed for r in records),
        num_timed_out=sum(r.timed_out for r in records),
        retracts=sum(r.retracts for r in records) if retracts is None else retracts,
        duration=duration,
        request_throughput=rate(len(done)),
        output_throughput=rate(output_tokens),
        input_throughput=rate(sum(r.prompt_tokens for r in done)),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached_tokens,
        cache_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else math.nan,
        ttft=LatencyStats.of([r.ttft for r in done if r.ttft is not None]),
        tpot=LatencyStats.of([r.tpot for r in done if r.tpot is not None]),
        itl=LatencyStats.of(gaps),
        e2e=LatencyStats.of([r.e2e for r in done if r.e2e is not None]),
    )
