"""Does the simulator predict a real run? Real replays of a workload, and the comparison.

Two ways to run a workload for real:

* ``replay_engine``: the real ``AsyncEngine`` (``sim.engine_replay.replay_real``) on the wall
  clock, with the process's CPU time measured beside it, so a run slowed by other load on the
  machine shows itself (CPU seconds / wall seconds well below the threads used).
* ``replay_measured``: the engine core with the real model (``build_core`` over a
  ``TimedExecutor`` around a ``ModelExecutor``, real sampled tokens) on a virtual clock advanced
  by each step's measured time: by default this thread's CPU time, which other processes inflate
  far less than wall time. With one torch thread all of a step's work (schedule, forward,
  sample, commit) runs on this thread. ``replay_measured_together`` runs several workloads in
  lockstep, so that a calibration run and a checked run see the same machine load.

``compare`` puts a simulated summary beside a measured one, metric by metric. The documented
check (docs/EXPERIMENTS.md) is ``scripts/sim_check.py``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from asyncengine.bench.records import BenchSummary, RequestRecord, summarize
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.cost_model import StepFeatures
from asyncengine.sim.engine_replay import replay_real
from asyncengine.sim.fidelity import MetricComparison
from asyncengine.sim.timed_executor import TimedExecutor
from asyncengine.sim.workload_replay import WorkloadReplay
from asyncengine.workloads import WorkloadRequest, random_lengths

ClockKind = Literal["cpu", "wall"]
# builds a step hook (EngineCore.step_hooks) for one replay's core and clock
StepHookFactory = Callable[[EngineCore, VirtualClock], Callable[[BatchPlan], None]]


@dataclass(slots=True)
class MeasuredRun:
    """A workload replayed on the real executor; times on the measured-step clock."""

    records: list[RequestRecord]
    summary: BenchSummary
    clock: ClockKind
    plans: list[BatchPlan]
    step_seconds: list[float]  # schedule + forward + sample + commit, per step
    virtual_seconds: float  # the clock at the end: the steps plus any wait for arrivals
    stats: dict[str, Any] = field(default_factory=dict)  # the core's stats() at the end

    @property
    def steps(self) -> int:
        return len(self.step_seconds)

    @property
    def step_features(self) -> list[StepFeatures]:
        return [StepFeatures.of_plan(plan) for plan in self.plans]


@dataclass(slots=True)
class EngineRun:
    """A workload replayed on the real AsyncEngine, on the wall clock."""

    records: list[RequestRecord]
    summary: BenchSummary
    wall_seconds: float
    cpu_seconds: float  # this process's CPU time over the same span
    torch_threads: int
    engine_stats: dict[str, object] = field(default_factory=dict)

    @property
    def cpu_share(self) -> float:
        """CPU seconds per wall second per torch thread: about 1 on an otherwise idle machine."""
        return self.cpu_seconds / (self.wall_seconds * self.torch_threads)


def compare(simulated: BenchSummary, measured: BenchSummary) -> list[MetricComparison]:
    """Throughput and mean/median latencies of two runs of the same workload."""
    pairs: list[tuple[str, str, Callable[[BenchSummary], float]]] = [
        ("output throughput", "tok/s", lambda s: s.output_throughput),
        ("duration", "s", lambda s: s.duration),
        ("mean TTFT", "s", lambda s: s.ttft.mean),
        ("median TTFT", "s", lambda s: s.ttft.p50),
        ("mean ITL", "s", lambda s: s.itl.mean),
        ("median ITL", "s", lambda s: s.itl.p50),
        ("mean E2E", "s", lambda s: s.e2e.mean),
        ("median E2E", "s", lambda s: s.e2e.p50),
    ]
    return [
        MetricComparison(name, unit, get(simulated), get(measured)) for name, unit, get in pairs
    ]


def by_name(rows: Sequence[MetricComparison]) -> dict[str, MetricComparison]:
    return {row.name: row for row in rows}


def markdown_comparison(
    measured_label: str, simulations: dict[str, Sequence[MetricComparison]]
) -> str:
    """One row per metric: the measured value, then each simulation's value and its error."""

    def value(x: float, unit: str) -> str:
        return f"{x * 1e3:.1f} ms" if unit == "s" and x < 1 else f"{x:.2f} {unit}"

    def error(row: MetricComparison) -> str:
        e = row.relative_error
        return "-" if math.isnan(e) else f"{e * 100:.1f}%"

    header = f"| metric | {measured_label} |"
    rule = "|---|---:|"
    for label in simulations:
        header += f" {label} | error |"
        rule += "---:|---:|"
    lines = [header, rule]
    columns = list(simulations.values())
    for i, first in enumerate(columns[0]):
        line = f"| {first.name} | {value(first.measured, first.unit)} |"
        for rows in columns:
            line += f" {value(rows[i].simulated, rows[i].unit)} | {error(rows[i])} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


# -- the real executor on a measured-step clock ----------------------------------------------


class _MeasuredReplay:
    """One workload on its own engine core (the real model), advanced a step at a time."""

    def __init__(
        self,
        config: EngineConfig,
        workload: Sequence[WorkloadRequest],
        timer: Callable[[], float],
        forward_repeats: int,
        step_hook: StepHookFactory | None = None,
    ) -> None:
        from asyncengine.executor.model_executor import ModelExecutor

        self.clock = VirtualClock()
        self.executor = TimedExecutor(ModelExecutor(config), self.clock, timer, forward_repeats)
        self.core = build_core(config, self.executor, clock=self.clock)
        self._warm_up()
        if step_hook is not None:
            self.core.step_hooks.append(step_hook(self.core, self.clock))
        self.replay = WorkloadReplay(self.core, self.clock, workload, overhead_timer=timer)

    def _warm_up(self) -> None:
        """One small prefill and decode, so first-call costs (allocator, dispatch) stay out;
        then the core is as new (clock, cache, counters, scheduling state)."""
        params = SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=0.0)
        self.core.add(Request("warm-up", list(range(1, 17)), params, 0.0))
        while self.core.has_work():
            self.core.step()
        sched = self.core.scheduler
        sched.new_token_ratio = sched.config.init_new_token_ratio
        self.core.reset_prefix_cache(reset_counters=True)
        self.clock.now = 0.0

    def result(self, clock_kind: ClockKind) -> MeasuredRun:
        records = self.replay.records()
        stats = self.core.scheduler.stats()
        summary = summarize(records, retracts=int(stats["retractions"]))
        return MeasuredRun(
            records,
            summary,
            clock_kind,
            self.replay.plans,
            self.replay.step_seconds,
            self.clock.now,
            self.core.stats(),
        )


def replay_measured_together(
    config: EngineConfig | Sequence[EngineConfig],
    workloads: Sequence[Sequence[WorkloadRequest]],
    clock: ClockKind = "cpu",
    forward_repeats: int = 1,
    step_hook: StepHookFactory | None = None,
) -> list[MeasuredRun]:
    """Replay several workloads in lockstep, one step of each in turn, each on its own engine
    state and virtual clock (see ``replay_measured``); ``config`` is one for all or one per
    workload. Whatever slows the machine down while they run slows them all alike, so a cost
    model fitted on one of them can be checked against another without the machine's load
    changing in between. ``step_hook`` (if given) builds a step hook for each replay."""
    configs = [config] * len(workloads) if isinstance(config, EngineConfig) else list(config)
    if len(configs) != len(workloads):
        raise ValueError(f"{len(configs)} configs for {len(workloads)} workloads")
    if forward_repeats < 1:
        raise ValueError(f"forward_repeats must be >= 1, got {forward_repeats}")
    if clock == "cpu" and torch.get_num_threads() != 1:
        raise ValueError(
            "clock='cpu' measures this thread only: call torch.set_num_threads(1) first "
            f"(now {torch.get_num_threads()})"
        )
    timer = time.thread_time if clock == "cpu" else time.perf_counter
    replays = [
        _MeasuredReplay(one_config, workload, timer, forward_repeats, step_hook)
        for one_config, workload in zip(configs, workloads, strict=True)
    ]
    while not all(r.replay.done() for r in replays):
        for r in replays:
            if not r.replay.done():
                r.replay.step()
    return [r.result(clock) for r in replays]


def replay_measured(
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    clock: ClockKind = "cpu",
    forward_repeats: int = 1,
    step_hook: StepHookFactory | None = None,
) -> MeasuredRun:
    """Run ``workload`` through the real scheduler and executor, step by step on this thread.

    Requests arrive at their workload times on a virtual clock that each step advances by its
    measured duration: ``cpu`` (this thread's CPU time; needs ``torch.get_num_threads() == 1``
    so that the forward runs here) or ``wall``. Tokens are stamped when their step's forward
    and sampling end, as in the engine; the commit's own cost is added after it.

    ``forward_repeats`` > 1 runs every step's forward that many times and counts the fastest:
    a greedy forward is idempotent (the same KV slots get the same values, the same tokens
    come out), and the minimum drops the slow-downs that other processes cause.
    """
    return replay_measured_together(config, [workload], clock, forward_repeats, step_hook)[0]


def replay_engine(
    config: EngineConfig, workload: Sequence[WorkloadRequest], torch_threads: int = 1
) -> EngineRun:
    """``replay_real`` with ``torch_threads`` intra-op threads, and the CPU time it used."""
    previous = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        records, stats = asyncio.run(replay_real(config, workload))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        torch.set_num_threads(previous)
    retracts = stats.get("retractions")
    summary = summarize(records, retracts=None if retracts is None else int(retracts))  # type: ignore[call-overload]
    return EngineRun(records, summary, wall, cpu, torch_threads, stats)


# -- the documented check ----------------------------------------------------------------


def check_workload(
    num_requests: int = 32, vocab_size: int = 49152, seed: int = 0
) -> list[WorkloadRequest]:
    """The sim-vs-real workload: short random prompts and outputs, all arriving at once."""
    return random_lengths(
        num_requests,
        vocab_size=vocab_size,
        input_median=96.0,
        input_sigma=0.8,
        output_median=24.0,
        output_sigma=0.5,
        max_input_len=768,
        max_output_len=64,
        seed=seed,
    )
