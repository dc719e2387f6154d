"""Adapter fairness: the cold adapters' TTFT under a hot adapter's flood, simulated or real.

One adapter floods the engine and seven others send a few requests each
(``workloads.adapters.hot_adapter_flood``). For each policy the same cold requests run twice:
with the flood and alone. A policy is fair to the cold adapters when their p99 TTFT under the
flood stays within a small factor of their p99 alone; ``fcfs`` makes them wait behind the
flood's backlog. A runner runs each workload: ``simulated`` (a cost model on a virtual clock,
deterministic: the same arguments give the same table) or ``real`` (the engine on the wall
clock, the adapters loaded from disk).

Each row also lists every cold request (``cold_requests``): its adapter, arrival, TTFT with the
flood and alone, its wait before it was first scheduled, whether it was retracted, the steps
admission kept it waiting by reason and, on the real engine, the batch of the step it was
admitted into: what a p99 made by a few requests needs to be explained.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from asyncengine.bench.records import RequestRecord
from asyncengine.common.config import EngineConfig
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.simulator import simulate
from asyncengine.sim.step_log import StepLog
from asyncengine.workloads.adapters import HOT_ADAPTER, hot_adapter_flood
from asyncengine.workloads.trace import WorkloadRequest

# The engine the comparison runs: room in one step for every adapter of the workload (so the
# order decides, not the slot limit), a running batch a CPU serves, and prefill budgeted per
# step so that one step's prompts do not hold everyone's first token.
FAIRNESS_ENGINE: dict[str, Any] = {"max_loras": 8, "max_running_requests": 32, "log_interval": 0}
PREFILL_BUDGET = {"token-budget": {"prefill_tokens": 512}}


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """A row of the table: a label, the policy spec and its options."""

    label: str
    policy: str
    options: dict[str, Any] = field(default_factory=dict)


DEFAULT_RUNS: tuple[PolicyRun, ...] = (
    PolicyRun("fcfs", "fcfs+token-budget", PREFILL_BUDGET),
    PolicyRun("lora-fair", "lora-fair+token-budget", PREFILL_BUDGET),
    PolicyRun(
        "lora-fair, preempt = false",
        "lora-fair+token-budget",
        {**PREFILL_BUDGET, "lora-fair": {"preempt": False}},
    ),
)


@dataclass(frozen=True, slots=True)
class FairnessRow:
    label: str
    policy: str
    cold_p99_alone: float  # seconds
    cold_p99_flood: float
    cold_p50_alone: float
    cold_p50_flood: float
    hot_p50_flood: float
    hot_output_throughput: float  # the flooding adapter's output tokens per second
    preemptions: int
    # each cold request with the flood and alone (cold_request), by arrival; not in the table
    cold_requests: tuple[dict[str, Any], ...] = ()

    @property
    def ratio(self) -> float:
        """Cold p99 TTFT under the flood over cold p99 TTFT alone."""
        return self.cold_p99_flood / self.cold_p99_alone

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


@dataclass(frozen=True, slots=True)
class Outcome:
    """One workload's run: its records, how long it took, the requests preempted, and what
    each step ran (the real runner's; None from the simulator)."""

    records: list[RequestRecord]
    seconds: float  # virtual seconds (simulated) or wall seconds from the first arrival (real)
    preemptions: int
    steps: StepLog | None = None


Runner = Callable[[EngineConfig, Sequence[WorkloadRequest]], Outcome]


def simulated(cost_model: CostModel | None = None) -> Runner:
    """Runs a workload in the simulator (``cost_model``: the shipped one when None), its
    adapters loaded at start as ``real`` loads them (only their names matter here)."""

    def run(config: EngineConfig, workload: Sequence[WorkloadRequest]) -> Outcome:
        names = sorted({w.lora for w in workload if w.lora is not None})
        loaded = config.replace(loras={name: name for name in names})
        result = simulate(loaded, workload, cost_model)
        preempted = int(result.scheduler_stats["preemptions"])
        return Outcome(result.records, result.virtual_seconds, preempted)

    return run


def real(loras: Mapping[str, str]) -> Runner:
    """Runs a workload on the real engine (``engine_replay.replay_real``) with ``loras`` (name
    -> PEFT directory; every adapter the workload names) loaded, one engine per run."""
    from asyncengine.sim.engine_replay import replay_real

    def run(config: EngineConfig, workload: Sequence[WorkloadRequest]) -> Outcome:
        missing = sorted({w.lora for w in workload if w.lora is not None} - set(loras))
        if missing:
            raise ValueError(f"no adapter directory for {', '.join(missing)}")
        steps = StepLog()
        records, stats = asyncio.run(
            replay_real(config.replace(loras=dict(loras)), workload, step_log=steps)
        )
        span = max((r.finish_time or 0.0 for r in records), default=0.0)
        preempted = int(stats["preemptions"])  # type: ignore[call-overload]
        return Outcome(records, span, preempted, steps)

    return run


def _checked(outcome: Outcome, workload: Sequence[WorkloadRequest]) -> Outcome:
    """The table splits records by adapter: each record must name its request's adapter."""
    adapters = {item.rid: item.lora for item in workload}
    wrong = [r.rid for r in outcome.records if adapters.get(r.rid, "?") != r.lora]
    if wrong or len(outcome.records) != len(workload):
        raise RuntimeError(
            f"{len(outcome.records)} records for {len(workload)} requests, {len(wrong)} not "
            f"naming their request's adapter (first: {wrong[:1]})"
        )
    return outcome


def _ttfts(records: Sequence[RequestRecord], hot: bool) -> list[float]:
    return [
        r.ttft
        for r in records
        if r.ttft is not None and r.completed and (r.lora == HOT_ADAPTER) == hot
    ]


def cold_request(
    flood: RequestRecord, alone: RequestRecord | None, steps: StepLog | None
) -> dict[str, Any]:
    """One cold request as the JSON lists it: its times under the flood (and alone), in
    seconds from the first arrival."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 4)

    admitted = steps.first_extend(flood.rid) if steps is not None else None
    return {
        "rid": flood.rid,
        "adapter": flood.lora,
        "arrival": rounded(flood.arrival_time),
        "ttft": rounded(flood.ttft),
        "ttft_alone": rounded(alone.ttft) if alone is not None else None,
        "queue_time": rounded(flood.queue_time),
        "retracts": flood.retracts,
        "blocked": flood.blocked,
        "admitted_into": admitted.batch() if admitted is not None else None,
    }


def lora_fairness(
    runs: Sequence[PolicyRun] = DEFAULT_RUNS,
    *,
    engine: dict[str, Any] | None = None,
    cost_model: CostModel | None = None,
    runner: Runner | None = None,
    **workload: Any,
) -> list[FairnessRow]:
    """One row per run: the cold adapters' TTFT with the flood and alone (``workload``: the
    arguments of ``hot_adapter_flood``; ``engine``: config keys over ``FAIRNESS_ENGINE``;
    ``runner``: ``simulated(cost_model)`` unless given)."""
    settings = {**FAIRNESS_ENGINE, **(engine or {})}
    run_workload = runner or simulated(cost_model)
    flood = hot_adapter_flood(include_hot=True, **workload)
    alone = hot_adapter_flood(include_hot=False, **workload)
    rows = []
    for run in runs:
        config = EngineConfig(policy=run.policy, policy_options=run.options, **settings)
        with_flood = _checked(run_workload(config, flood), flood)
        by_itself = _checked(run_workload(config, alone), alone)
        cold_flood = _ttfts(with_flood.records, hot=False)
        cold_alone = _ttfts(by_itself.records, hot=False)
        hot = [r for r in with_flood.records if r.lora == HOT_ADAPTER and r.completed]
        hot_tokens = sum(r.output_tokens for r in hot)
        rows.append(
            FairnessRow(
                run.label,
                run.policy,
                float(np.percentile(cold_alone, 99)),
                float(np.percentile(cold_flood, 99)),
                float(np.percentile(cold_alone, 50)),
                float(np.percentile(cold_flood, 50)),
                float(np.percentile(_ttfts(with_flood.records, hot=True), 50)),
                hot_tokens / with_flood.seconds,
                with_flood.preemptions,
                _cold_requests(with_flood, by_itself),
            )
        )
    return rows


def _cold_requests(flood: Outcome, alone: Outcome) -> tuple[dict[str, Any], ...]:
    by_rid = {r.rid: r for r in alone.records}
    cold = [r for r in flood.records if r.lora != HOT_ADAPTER]
    cold.sort(key=lambda r: (r.arrival_time, r.rid))
    return tuple(cold_request(r, by_rid.get(r.rid), flood.steps) for r in cold)


def fairness_table(rows: Sequence[FairnessRow]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| policy | cold TTFT p99 alone | cold TTFT p99 under the flood | ratio | cold p50 alone "
        "| cold p50 flood | hot TTFT p50 | hot output tok/s | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.label} | {row.cold_p99_alone:.2f} s | {row.cold_p99_flood:.2f} s | "
            f"{row.ratio:.2f}x | {row.cold_p50_alone:.2f} s | {row.cold_p50_flood:.2f} s | "
            f"{row.hot_p50_flood:.2f} s | {row.hot_output_throughput:.1f} | {row.preemptions} |"
        )
    return "\n".join(lines)
