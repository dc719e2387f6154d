"""What a reproduction is: a published claim, and a run of ours that checks it.

A reproduction names the claim and its source, builds its own setting (workload, engine
configs), runs it in the simulator (or, with ``real``, on the real executor on the CPU it runs on, each
step timed on this thread's CPU clock) and returns an ``Outcome``: our setting, a table of our
numbers beside the claim's, a verdict, and the numbers as JSON. ``run_workload`` is the one
way every reproduction runs a configuration, so the simulated and the real run go through the
same scheduler, policies and step hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncengine.bench.records import BenchSummary, RequestRecord, summarize
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan
from asyncengine.core.engine_core import EngineCore
from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.simulator import Simulator
from asyncengine.workloads.trace import WorkloadRequest

# Builds a step hook for one run's core and clock (EngineCore.step_hooks: after every landed
# step, with its plan); the hook reads what it needs from the core at that moment.
HookFactory = Callable[[EngineCore, VirtualClock], Callable[[BatchPlan], None]]

# The real engine of the --real runs: the embedded model on the CPU, one torch thread.
REAL_BASE = EngineConfig(model="smollm2-135m", device="cpu", log_interval=0.0)


@dataclass(frozen=True, slots=True)
class Claim:
    """What was published, in one or two sentences, and where."""

    text: str
    source: str
    url: str


@dataclass(slots=True)
class Outcome:
    """One run of a reproduction (markdown pieces, and the numbers behind them)."""

    setting: str  # our setting, a paragraph
    table: str  # our numbers beside the claim's (markdown)
    verdict: str  # does the claim hold here, and where it differs
    holds: bool
    numbers: dict[str, Any] = field(default_factory=dict)


class Reproduction(Protocol):
    name: str  # the command-line name
    title: str
    claim: Claim

    def run(self, real: bool) -> Outcome: ...


@dataclass(slots=True)
class Run:
    """One configuration over one workload."""

    label: str
    records: list[RequestRecord]
    summary: BenchSummary
    steps: int
    virtual_seconds: float
    stats: dict[str, Any]


def run_workload(
    label: str,
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    *,
    real: bool = False,
    cost_model: CostModel | None = None,
    hook: HookFactory | None = None,
    real_base: EngineConfig = REAL_BASE,
) -> Run:
    """``workload`` under ``config``: simulated (the cost model on a virtual clock), or with
    ``real`` on the real executor (``real_base``'s model and device over ``config``'s
    scheduling keys), each step advancing the clock by its measured CPU time."""
    if real:
        import torch

        from asyncengine.sim.sim_vs_real import replay_measured

        real_config = config.replace(
            model=real_base.model, device=real_base.device, log_interval=0.0
        )
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the CPU clock measures this thread: the forward runs here
        try:
            measured = replay_measured(real_config, workload, step_hook=hook)
        finally:
            torch.set_num_threads(threads)
        return Run(
            label,
            measured.records,
            measured.summary,
            measured.steps,
            measured.virtual_seconds,
            measured.stats,
        )
    sim = Simulator(config, cost_model)
    if hook is not None:
        sim.core.step_hooks.append(hook(sim.core, sim.clock))
    result = sim.run(workload)
    return Run(
        label,
        result.records,
        summarize(result.records, retracts=int(result.scheduler_stats["retractions"])),
        result.steps,
        result.virtual_seconds,
        result.core_stats,
    )


def seconds(value: float) -> str:
    """A duration as people read it: ms below a second, s up to minutes."""
    if value != value:  # NaN
        return "-"
    if value < 1.0:
        return f"{value * 1e3:.0f} ms"
    return f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
