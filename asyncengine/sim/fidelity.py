"""How faithful the simulator is to the real engine: metric errors, and a measured run written
as a live trace so that its cost model is fitted the way a user fits one (``--fit-from-trace``).

``scripts/sim_check.py`` runs the check: policies x workloads on the real executor (CPU clock)
and in the simulator with a cost model fitted from the recorded calibration traces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncengine.bench.records import BenchSummary, RequestRecord
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.sim.workload_replay import params_for
from asyncengine.workloads.trace import WorkloadRequest
from asyncengine.workloads.trace_recorder import TraceRecorder

GOAL = 0.10  # the relative error the simulator aims at on every fidelity metric


@dataclass(frozen=True, slots=True)
class MetricComparison:
    name: str
    unit: str
    simulated: float
    measured: float

    @property
    def relative_error(self) -> float:
        """|simulated - measured| / measured (NaN when the measured value is 0 or NaN)."""
        if not self.measured or math.isnan(self.measured):
            return math.nan
        return abs(self.simulated - self.measured) / abs(self.measured)


# the metrics the fidelity goal is stated on
FIDELITY_METRICS: list[tuple[str, str, Callable[[BenchSummary], float]]] = [
    ("TTFT p50", "s", lambda s: s.ttft.p50),
    ("TTFT p99", "s", lambda s: s.ttft.p99),
    ("ITL p50", "s", lambda s: s.itl.p50),
    ("output throughput", "tok/s", lambda s: s.output_throughput),
]


def fidelity(simulated: BenchSummary, measured: BenchSummary) -> list[MetricComparison]:
    return [MetricComparison(n, u, get(simulated), get(measured)) for n, u, get in FIDELITY_METRICS]


def write_measured_trace(
    path: str | Path,
    workload: Sequence[WorkloadRequest],
    plans: Sequence[BatchPlan],
    step_seconds: Sequence[float],
    records: Sequence[RequestRecord],
    *,
    page_size: int,
    vocab_size: int,
) -> Path:
    """A measured run as a live trace (the format ``serve --record-trace`` writes): every
    arrival, every step with its measured seconds, every finish."""
    recorder = TraceRecorder(
        path, start=0.0, page_size=page_size, vocab_size=vocab_size, meta={"source": "sim_check"}
    )
    try:
        for item in workload:
            req = Request(item.rid, list(item.prompt_ids), params_for(item), item.arrival_time)
            recorder.arrival(req, item.rid)
        now = 0.0
        for plan, seconds in zip(plans, step_seconds, strict=True):
            now += seconds
            recorder.step(plan, seconds, now)
        by_rid = {rid: item for item in workload for rid in item.choice_rids}
        for record in records:
            req = Request(record.rid, list(by_rid[record.rid].prompt_ids), params_for(by_rid[record.rid]), record.arrival_time)  # fmt: skip
            req.output_ids = [0] * record.output_tokens
            req.finished_time = record.finish_time
            req.cached_tokens = record.cached_tokens
            recorder.finish(req, record.finish_time or now, "abort" if record.failed else "length")
    finally:
        recorder.close()
    return Path(path)
