"""The fidelity report's pieces: a measured run written as a live trace and fitted back."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncengine.bench.records import RequestRecord, summarize
from asyncengine.common.config import EngineConfig
from asyncengine.core.builder import build_core
from asyncengine.sim import CostModel, SimulatedExecutor, VirtualClock, WorkloadReplay
from asyncengine.sim.fidelity import GOAL, fidelity, write_measured_trace
from asyncengine.workloads import Arrivals, random_lengths
from asyncengine.workloads.live_trace import load_live_trace

TRUE = CostModel(0.02, 4e-4, 2e-7, 1e-3, 3e-6, description="the truth")


def test_a_recorded_trace_gives_back_the_cost_model_that_timed_it(tmp_path: Path) -> None:
    workload = random_lengths(40, vocab_size=500, input_median=60, output_median=12,
                              arrivals=Arrivals("poisson", rate=5.0), seed=3)  # fmt: skip
    clock = VirtualClock()
    core = build_core(EngineConfig(log_interval=0), SimulatedExecutor(TRUE, clock), clock=clock)
    replay = WorkloadReplay(core, clock, workload, overhead_timer=lambda: 0.0)  # keeps the plans
    records = replay.run()
    path = write_measured_trace(
        tmp_path / "run.trace.jsonl", workload, replay.plans, replay.step_seconds, records,
        page_size=16, vocab_size=500,
    )  # fmt: skip
    trace = load_live_trace(path)
    assert [r.rid for r in trace.requests] == [w.rid for w in workload]
    assert len(trace.steps) == replay.steps
    assert all(trace.finish_reasons[r.rid] == "length" for r in records)
    fitted = CostModel.from_live_trace(path)
    for got, want in zip(fitted.coefficients, TRUE.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_fidelity_errors_are_relative_to_the_real_run() -> None:
    def record(ttft: float, gap: float) -> RequestRecord:
        times = [ttft + i * gap for i in range(5)]
        return RequestRecord("r", 0.0, 10, token_times=times, finish_time=times[-1])

    real = summarize([record(1.0, 0.1)])
    sim = summarize([record(1.05, 0.1)])
    errors = {row.name: row.relative_error for row in fidelity(sim, real)}
    assert errors["TTFT p50"] == pytest.approx(0.05)
    assert errors["ITL p50"] == pytest.approx(0.0, abs=1e-12)
    assert errors["TTFT p50"] < GOAL
    assert not math.isnan(errors["output throughput"])


def test_too_short_a_trace_is_refused(tmp_path: Path) -> None:
    path = write_measured_trace(tmp_path / "t.jsonl", [], [], [], [], page_size=16, vocab_size=10)
    with pytest.raises(ValueError, match="too few"):
        CostModel.from_live_trace(path)
