"""Speculative decoding in the simulator: guesses cost what extend tokens cost, each request's
guesses are accepted at its workload ``acceptance``, so speculation rules can be ranked on a
trace (scripts/compare_policies.py over a JSONL trace that carries ``acceptance``)."""

from __future__ import annotations

from pathlib import Path

from asyncengine.common.config import EngineConfig
from asyncengine.sim.simulator import simulate
from asyncengine.workloads.trace import WorkloadRequest, load_trace, save_trace


def workload(batch: int, acceptance: float | None) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(f"r{i}", 0.0, [10 + i] * 5 + list(range(20, 60)), 64, acceptance=acceptance)
        for i in range(batch)
    ]


def config(rule: str | None) -> EngineConfig:
    speculative = None if rule is None else {"num_speculative_tokens": 4, "rule": rule}
    return EngineConfig(speculative=speculative, log_interval=0)


def test_a_trace_keeps_each_requests_acceptance(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    save_trace(path, workload(2, 0.75) + workload(1, None))
    assert [r.acceptance for r in load_trace(path)] == [0.75, 0.75, None]


def test_accepted_guesses_shorten_a_single_stream_and_failing_ones_cost() -> None:
    off = simulate(config(None), workload(1, 0.9))
    on = simulate(config("fixed"), workload(1, 0.9))
    assert on.summary.output_tokens == off.summary.output_tokens == 64
    assert on.steps < off.steps * 0.6
    assert on.core_stats["spec_acceptance_rate"] > 0.5
    # nothing accepted: every step verifies guesses for nothing and takes longer
    lost = simulate(config("fixed"), workload(1, 0.0))
    assert lost.steps == off.steps and lost.virtual_seconds > off.virtual_seconds


def test_the_adaptive_rule_ranks_above_fixed_where_guesses_fail() -> None:
    fixed = simulate(config("fixed"), workload(64, 0.05))
    adaptive = simulate(config("adaptive"), workload(64, 0.05))
    assert adaptive.virtual_seconds < fixed.virtual_seconds
    assert adaptive.core_stats["spec_verified_tokens"] < fixed.core_stats["spec_verified_tokens"]


def test_speculation_trace_mixes_copy_heavy_and_random_requests() -> None:
    from asyncengine.workloads.copy_heavy import speculation_trace

    trace = speculation_trace(200, copy_share=0.3, seed=1)
    assert trace == speculation_trace(200, copy_share=0.3, seed=1)
    copy = [r for r in trace if r.acceptance is not None and r.acceptance >= 0.75]
    rest = [r for r in trace if r.acceptance is not None and r.acceptance <= 0.15]
    assert len(copy) + len(rest) == 200 and 40 < len(copy) < 80
    assert all(a.arrival_time < b.arrival_time for a, b in zip(trace, trace[1:], strict=False))
