"""Does the simulator predict a real run? Replays on the real executor, and the comparison.

Two ways to run a workload for real:

* ``replay_engine``: the real ``AsyncEngine`` (``bench.replay.replay_real``) on the wall clock,
  with the process's CPU time measured beside it, so a run slowed by other load on the machine
  shows itself (CPU seconds / wall seconds well below the threads used).
* ``replay_measured``: the engine's own loop without asyncio (the real Scheduler, policy, KV
  cache manager and ModelRunner, real sampled tokens) on a clock advanced by each step's
  measured time: by default this thread's CPU time, which other processes inflate far less
  than wall time. With one torch thread all of a step's work (schedule, forward, sample,
  commit) runs on this thread. ``replay_measured_together`` runs several workloads in
  lockstep, so that a calibration run and a checked run see the same machine load.

``compare`` puts a simulated summary beside a measured one, metric by metric. ``main`` is the
documented check (docs/EXPERIMENTS.md): the shipped cost model and one calibrated on real steps
against the real executor, and against the real AsyncEngine:

    python -m asyncengine.bench.sim_check --out docs/experiments/sim_vs_real
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from asyncengine.bench.metrics import BenchSummary, RequestRecord, summarize
from asyncengine.bench.replay import params_for, replay_real
from asyncengine.cache.manager import KVCacheManager
from asyncengine.config import EngineConfig
from asyncengine.executor.loader import load_hf_config, load_weights, resolve_model
from asyncengine.executor.model_config import ModelConfig
from asyncengine.executor.runner import ModelRunner
from asyncengine.executor.sampler import Sampler
from asyncengine.plan import BatchPlan
from asyncengine.request import Request
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler
from asyncengine.sim.cost_model import CostModel, StepFeatures
from asyncengine.sim.simulator import VirtualClock, simulate
from asyncengine.worker import build_kv_memory, pick_device, pick_dtype
from asyncengine.workloads import WorkloadRequest, random_lengths
from policies.registry import make_policy

ClockKind = Literal["cpu", "wall"]


@dataclass(slots=True)
class MeasuredRun:
    """A workload replayed on the real executor; times on the measured-step clock."""

    records: list[RequestRecord]
    summary: BenchSummary
    clock: ClockKind
    plans: list[BatchPlan]
    step_seconds: list[float]  # schedule + forward + sample + commit, per step
    virtual_seconds: float  # the clock at the end: the steps plus any wait for arrivals

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


@dataclass(slots=True)
class _RealParts:
    runner: ModelRunner
    kv: KVCacheManager
    eos_token_ids: list[int]
    max_model_len: int


def _build(config: EngineConfig) -> _RealParts:
    """What ``worker.build_engine_parts`` builds, less the tokenizer (token ids in, ids out)."""
    device = pick_device(config)
    dtype = pick_dtype(config, device)
    path = resolve_model(config.model, dtype)
    model_config = ModelConfig.from_hf_dict(load_hf_config(path))
    pool, kv, max_model_len = build_kv_memory(config, model_config, dtype, device)
    eos = list(model_config.eos_token_ids)
    runner = ModelRunner(
        model_config,
        load_weights(path, dtype),
        pool,
        kv.page_table,
        dtype=dtype,
        device=device,
        backend=config.attention_backend,
        sampler=Sampler(eos_token_ids=eos, seed=config.seed),
        enable_cuda_graph=False,
        max_batch_size=config.max_running_requests,
    )
    return _RealParts(runner, kv, eos, max_model_len)


def _warm_up(parts: _RealParts, config: EngineConfig) -> None:
    """One small prefill and decode, so first-call costs (allocator, dispatch) stay out."""
    sched = Scheduler(
        config, parts.kv, make_policy("fcfs"), parts.eos_token_ids, parts.max_model_len
    )
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=0.0)
    sched.add_request(Request("warm-up", list(range(1, 17)), params, 0.0))
    while sched.has_work():
        plan = sched.schedule()
        if plan is not None:
            sched.commit(plan, parts.runner.execute(plan))
    parts.kv.reset(reset_counters=True)


class _MeasuredReplay:
    """One workload on its own scheduler, KV memory and virtual clock, advanced step by step."""

    def __init__(
        self,
        config: EngineConfig,
        parts: _RealParts,
        workload: Sequence[WorkloadRequest],
        timer: Callable[[], float],
        forward_repeats: int,
    ) -> None:
        self.parts = parts
        self.workload = workload
        self.timer = timer
        self.forward_repeats = forward_repeats
        self.clock = VirtualClock()
        policy = make_policy(config.policy, config.policy_options)
        self.sched = Scheduler(
            config, parts.kv, policy, parts.eos_token_ids, parts.max_model_len, clock=self.clock
        )
        self.pending = sorted(workload, key=lambda w: w.arrival_time)
        self.next_arrival = 0
        self.requests: dict[str, Request] = {}
        self.plans: list[BatchPlan] = []
        self.step_seconds: list[float] = []

    def done(self) -> bool:
        return self.next_arrival == len(self.pending) and not self.sched.has_work()

    def step(self) -> None:
        """Run one step (after letting in the requests that have arrived by now)."""
        sched, clock, timer = self.sched, self.clock, self.timer
        while True:
            while (
                self.next_arrival < len(self.pending)
                and self.pending[self.next_arrival].arrival_time <= clock.now
            ):
                item = self.pending[self.next_arrival]
                req = Request(item.rid, list(item.prompt_ids), params_for(item), item.arrival_time)
                self.requests[item.rid] = req
                sched.add_request(req)
                self.next_arrival += 1
            start = timer()
            plan = sched.schedule() if sched.has_work() else None
            if plan is not None:
                break
            if self.next_arrival == len(self.pending):
                raise RuntimeError(f"scheduler is stuck at t={clock.now:.3f}s: {sched.stats()}")
            clock.advance_to(self.pending[self.next_arrival].arrival_time)
        schedule_seconds = timer() - start
        forward_seconds = math.inf
        for _ in range(self.forward_repeats):
            forward_start = timer()
            output = self.parts.runner.execute(plan)
            forward_seconds = min(forward_seconds, timer() - forward_start)
        output.forward_seconds = forward_seconds
        clock.advance(schedule_seconds + forward_seconds)  # tokens are out: stamp them now
        commit_start = timer()
        sched.commit(plan, output)
        commit_seconds = timer() - commit_start
        clock.advance(commit_seconds)
        self.plans.append(plan)
        self.step_seconds.append(schedule_seconds + forward_seconds + commit_seconds)

    def result(self, clock_kind: ClockKind) -> MeasuredRun:
        records = []
        for item in self.workload:
            req = self.requests[item.rid]
            record = RequestRecord(item.rid, item.arrival_time, len(item.prompt_ids))
            record.token_times = req.token_times
            record.finish_time = req.finished_time
            record.cached_tokens = req.cached_tokens
            record.retracts = req.retractions
            record.failed = req.finish_reason == "abort"
            records.append(record)
        summary = summarize(records, retracts=int(self.sched.stats()["retractions"]))
        return MeasuredRun(
            records, summary, clock_kind, self.plans, self.step_seconds, self.clock.now
        )


def replay_measured_together(
    config: EngineConfig | Sequence[EngineConfig],
    workloads: Sequence[Sequence[WorkloadRequest]],
    clock: ClockKind = "cpu",
    forward_repeats: int = 1,
) -> list[MeasuredRun]:
    """Replay several workloads in lockstep, one step of each in turn, each on its own engine
    state and virtual clock (see ``replay_measured``); ``config`` is one for all or one per
    workload. Whatever slows the machine down while they run slows them all alike, so a cost
    model fitted on one of them can be checked against another without the machine's load
    changing in between."""
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
    replays = []
    for one_config, workload in zip(configs, workloads, strict=True):
        parts = _build(one_config)
        _warm_up(parts, one_config)
        replays.append(_MeasuredReplay(one_config, parts, workload, timer, forward_repeats))
    while not all(replay.done() for replay in replays):
        for replay in replays:
            if not replay.done():
                replay.step()
    return [replay.result(clock) for replay in replays]


def replay_measured(
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    clock: ClockKind = "cpu",
    forward_repeats: int = 1,
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
    return replay_measured_together(config, [workload], clock, forward_repeats)[0]


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


def _step_fit(run: MeasuredRun, cost: CostModel) -> dict[str, float]:
    """How the cost model's per-step predictions compare with the measured steps."""
    predicted = [cost.time_of(f) for f in run.step_features]
    ratios = sorted(m / p for m, p in zip(run.step_seconds, predicted, strict=True))
    largest = max(range(run.steps), key=lambda i: run.step_seconds[i])
    return {
        "steps": run.steps,
        "measured_seconds": sum(run.step_seconds),
        "predicted_seconds": sum(predicted),
        "median_measured_over_predicted": ratios[len(ratios) // 2],
        "largest_step_measured": run.step_seconds[largest],
        "largest_step_predicted": predicted[largest],
        "largest_step_prompts": len(run.plans[largest].extends),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto: the engine's pick (on CPU the faster of bf16 and fp32)",
    )
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--prefill-budget",
        type=int,
        default=512,
        help="max_prefill_tokens = chunked_prefill_size of the budgeted scenario",
    )
    parser.add_argument("--cost-model", default=None, help="JSON (default: the shipped one)")
    parser.add_argument("--skip-engine", action="store_true", help="no AsyncEngine run")
    parser.add_argument("--out", required=True, help="directory for sim_vs_real.md/.json")
    args = parser.parse_args(argv)

    base = EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", policy=args.policy, log_interval=0.0
    )
    budgeted = base.replace(
        max_prefill_tokens=args.prefill_budget, chunked_prefill_size=args.prefill_budget
    )
    workload = check_workload(args.num_requests)
    calibration = [check_workload(args.num_requests, seed=seed) for seed in (1, 2)]
    shipped = CostModel.load(args.cost_model) if args.cost_model else CostModel.default()
    torch.set_num_threads(1)
    # calibration and checked runs in lockstep: the machine's load cannot differ between them
    *calibration_runs, checked_budgeted, checked_defaults = replay_measured_together(
        [budgeted, budgeted, budgeted, base], [*calibration, workload, workload]
    )
    calibrated = CostModel.fit(
        [f for run in calibration_runs for f in run.step_features],
        [t for run in calibration_runs for t in run.step_seconds],
        description="fitted on the real executor's measured steps (CPU clock) of two "
        f"calibration workloads (seeds 1 and 2), prefill budget {args.prefill_budget}",
    )
    models = {"simulator, shipped cost model": shipped, "simulator, calibrated": calibrated}
    result: dict[str, object] = {
        "workload": {
            "requests": len(workload),
            "prompt_tokens": sum(len(w.prompt_ids) for w in workload),
            "output_tokens": sum(w.output_len for w in workload),
            "arrivals": "all at 0",
        },
        "cost_models": {name: asdict(model) for name, model in models.items()},
    }
    sections: list[str] = []
    scenarios = [
        (f"prefill budget {args.prefill_budget}", budgeted, checked_budgeted),
        ("engine defaults (prefill budget 4096)", base, checked_defaults),
    ]
    for name, config, run in scenarios:
        simulations = {label: simulate(config, workload, model) for label, model in models.items()}
        rows = {label: compare(sim.summary, run.summary) for label, sim in simulations.items()}
        steps = _step_fit(run, shipped)
        result[name] = {
            "cpu_clock_replay": run.summary.to_dict(),
            "step_fit_of_the_shipped_model": steps,
            **{
                label: {
                    "summary": sim.summary.to_dict(),
                    "steps": sim.steps,
                    "errors": {row.name: row.relative_error for row in rows[label]},
                }
                for label, sim in simulations.items()
            },
        }
        sections += [
            f"### {name}: simulator vs the real executor on a CPU-time clock\n",
            f"{run.steps} real steps, {', '.join(str(s.steps) for s in simulations.values())} "
            f"simulated; the same plans measured {steps['measured_seconds']:.2f} s, the shipped "
            f"model predicts {steps['predicted_seconds']:.2f} s (largest step, "
            f"{steps['largest_step_prompts']} prompts: {steps['largest_step_measured']:.2f} s "
            f"measured, {steps['largest_step_predicted']:.2f} s predicted).\n",
            markdown_comparison("real, CPU clock", rows),
        ]
    if not args.skip_engine:
        engine = replay_engine(budgeted, workload, torch_threads=1)
        rows = {
            label: compare(simulate(budgeted, workload, model).summary, engine.summary)
            for label, model in models.items()
        }
        result["engine_wall_clock"] = {
            "summary": engine.summary.to_dict(),
            "wall_seconds": engine.wall_seconds,
            "cpu_seconds": engine.cpu_seconds,
            "cpu_share": engine.cpu_share,
        }
        sections += [
            f"### prefill budget {args.prefill_budget}: simulator vs the real AsyncEngine "
            "on the wall clock\n",
            f"The engine process got {engine.cpu_share:.2f} CPU seconds per wall second "
            f"(one torch thread; {engine.cpu_seconds:.1f} s CPU in {engine.wall_seconds:.1f} s).\n",
            markdown_comparison("AsyncEngine, wall clock", rows),
        ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_vs_real.md").write_text("\n".join(sections), encoding="utf-8")
    (out / "sim_vs_real.json").write_text(
        json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8"
    )
    print("\n".join(sections))
    return result


if __name__ == "__main__":
    main()
