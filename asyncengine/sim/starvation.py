"""Starvation check for any policy: adversarial workloads in the simulator, drawn at random.

An adversary sends a steady stream of requests that policies like to serve first (short, on a
hot cached prefix, of better priority, from many fresh tenants; a seeded draw picks which of
these and how much) faster than the engine serves them, and a few victims shortly after it starts
(long, cold, of worse priority, from one tenant). Waits are counted in prefill tokens (the
prompt tokens the engine computes; machine independent, as LPM's aging counts them):

- a request's wait: the prefill tokens computed between its arrival and its admission;
- how far it was overtaken: the prefill tokens of requests that arrived after it and were
  admitted before it. FCFS overtakes nobody; a policy that reorders overtakes by design.

Each adversary runs twice, with its stream and with the stream twice as long. The check
asserts that every request completes (within a bounded number of steps: no livelock, no stuck
queue) and that no request's overtaking grows with the stream: a bounded policy overtakes a
victim by some amount and then serves it, so a longer stream adds nothing; a starving one lets
every later request pass, so the overtaking doubles (``growth``, 1.8, times or more fails).
A bound whose reach is beyond the stream looks unbounded too: the report says within which
stream it was found. With ``horizon_tokens`` the check also fails any overtaking above it.
It reports the worst wait and overtaking seen, and shrinks a failing adversary.

    report = check_starvation("lpm", {"aging": 0.05})
    python scripts/check_policy.py my_policies:MyPolicy --examples 40
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan
from asyncengine.scheduler.policy_guard import PolicyStalledError
from asyncengine.sim.simulator import Simulator
from asyncengine.sim.workload_replay import SchedulerStuckError, WorkloadReplay
from asyncengine.workloads.trace import WorkloadRequest

VOCAB = 32000
CHECK_CONFIG: dict[str, Any] = {
    "page_size": 16,
    "kv_cache_tokens": 16384,
    "max_running_requests": 8,
    "chunked_prefill_size": 512,
    "max_prefill_tokens": 2048,
    "log_interval": 0,
}


@dataclass(frozen=True, slots=True)
class Adversary:
    """One adversarial workload's knobs (``draw_adversary`` draws them; the defaults are a
    strong one)."""

    stream: int = 500  # requests in the favoured stream (judged with it and twice as many)
    gap_ms: float = 20.0  # between stream arrivals (more than the engine serves per second)
    stream_prompt: int = 64  # tokens after the hot prefix
    stream_output: int = 4
    hot_prefix: int = 256  # 0: no shared prefix
    stream_priority: int = -1  # victims have priority 5
    stream_tenants: int = 50  # distinct tenants in the stream (round robin); victims: "victim"
    victims: int = 1
    victim_prompt: int = 800
    victim_output: int = 64
    victim_after: int = 10  # stream requests before the first victim arrives
    seed: int = 0


def adversarial_workload(adv: Adversary) -> list[WorkloadRequest]:
    rng = np.random.default_rng(adv.seed)
    prefix = rng.integers(1, VOCAB, adv.hot_prefix).tolist()
    gap = adv.gap_ms / 1e3
    items = []
    for i in range(adv.stream):
        items.append(
            WorkloadRequest(
                f"stream-{i}",
                i * gap,
                prefix + rng.integers(1, VOCAB, adv.stream_prompt).tolist(),
                adv.stream_output,
                priority=adv.stream_priority,
                tenant=f"fresh-{i % max(adv.stream_tenants, 1)}",
            )
        )
    for v in range(adv.victims):
        items.append(
            WorkloadRequest(
                f"victim-{v}",
                (adv.victim_after + v) * gap + gap / 2,
                rng.integers(1, VOCAB, adv.victim_prompt).tolist(),
                adv.victim_output,
                priority=5,
                tenant="victim",
            )
        )
    return items


@dataclass(slots=True)
class Outcome:
    adversary: Adversary
    worst_wait_tokens: int  # prefill tokens computed while a request waited (the worst)
    worst_wait_request: str
    worst_overtaken_tokens: int  # prefill tokens of later arrivals admitted first (the worst)
    worst_overtaken_request: str
    problem: str | None  # None: passed
    overtaken: dict[str, int] = field(default_factory=dict)  # by request


class _Fenwick:
    def __init__(self, n: int) -> None:
        self.tree = [0] * (n + 1)

    def add(self, i: int, value: int) -> None:
        i += 1
        while i < len(self.tree):
            self.tree[i] += value
            i += i & -i

    def prefix(self, i: int) -> int:  # sum of positions < i
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total


def run_adversary(config: EngineConfig, adv: Adversary, step_factor: int = 20) -> Outcome:
    """Simulate one adversarial workload under ``config``: did everything complete, and how
    long did each request wait and how far was it overtaken (see the module notes)."""
    workload = adversarial_workload(adv)
    sim = Simulator(config)
    starts: list[float] = []  # each step's start time, and the prompt tokens it computed
    computed: list[int] = [0]  # cumulative

    def hook(plan: BatchPlan) -> None:
        starts.append(sim.clock.now - sim.executor.seconds(plan))
        computed.append(computed[-1] + sum(seg.num_tokens for seg in plan.extends))

    sim.core.step_hooks.append(hook)
    replay = WorkloadReplay(sim.core, sim.clock, workload)
    work = sum(len(w.prompt_ids) + w.output_len for w in workload)
    limit = step_factor * work // max(config.page_size, 1) + 1000
    while not replay.done():
        if replay.steps > limit:
            return Outcome(adv, -1, "", -1, "", f"livelock: {replay.steps} steps and not done")
        try:
            if replay.step() is None:
                break
        except (PolicyStalledError, SchedulerStuckError) as exc:
            return Outcome(adv, -1, "", -1, "", f"stuck: {exc}")
    admitted: list[tuple[float, int, str, int]] = []  # (admitted, arrival rank, rid, computed)
    by_arrival = sorted(workload, key=lambda w: (w.arrival_time, w.rid))
    worst_wait, wait_rid = 0, ""
    for rank, item in enumerate(by_arrival):
        req = replay.requests.get(item.rid)
        if req is None or req.finish_reason not in ("length", "stop"):
            reason = "refused" if req is None else req.finish_reason
            return Outcome(adv, -1, "", -1, "", f"{item.rid} did not complete ({reason})")
        start = req.first_scheduled_time
        assert start is not None
        first = bisect.bisect_left(starts, item.arrival_time)
        last = bisect.bisect_left(starts, start)
        waited = computed[last] - computed[first]
        if waited > worst_wait:
            worst_wait, wait_rid = waited, item.rid
        admitted.append((start, rank, item.rid, len(item.prompt_ids) - req.cached_tokens))
    # overtaking: in admission order, the prefill of later arrivals already admitted
    fenwick = _Fenwick(len(admitted))
    total = 0
    worst_over, over_rid = 0, ""
    overtaken: dict[str, int] = {}
    for _, rank, rid, tokens in sorted(admitted):
        over = total - fenwick.prefix(rank + 1)
        overtaken[rid] = over
        if over > worst_over:
            worst_over, over_rid = over, rid
        fenwick.add(rank, tokens)
        total += tokens
    return Outcome(adv, worst_wait, wait_rid, worst_over, over_rid, None, overtaken)


def judge(
    config: EngineConfig, adv: Adversary, growth: float, horizon_tokens: int | None
) -> tuple[Outcome, str | None]:
    """Run ``adv`` and its twice-as-long twin; the longer run's outcome and the problem found."""
    short = run_adversary(config, adv)
    if short.problem is not None:
        return short, short.problem
    longer = run_adversary(config, replace(adv, stream=2 * adv.stream))
    if longer.problem is not None:
        return longer, longer.problem
    for rid, over in longer.overtaken.items():
        before = short.overtaken.get(rid, 0)
        if rid.startswith("victim") and over > growth * before + 2 * adv.victim_prompt:
            return longer, (
                f"{rid} starved: overtaken by {before} prefill tokens of later requests in a "
                f"stream of {adv.stream} and by {over} in one of {2 * adv.stream}: the "
                "overtaking grows with the stream"
            )
    if horizon_tokens is not None and longer.worst_overtaken_tokens > horizon_tokens:
        return longer, (
            f"{longer.worst_overtaken_request} overtaken by {longer.worst_overtaken_tokens} "
            f"prefill tokens of later requests, more than the horizon of {horizon_tokens}"
        )
    return longer, None


@dataclass(slots=True)
class StarvationReport:
    policy: str
    options: dict[str, Any]
    examples: int
    horizon_tokens: int | None
    worst_wait_tokens: int
    worst_wait_request: str
    worst_overtaken_tokens: int
    worst_overtaken_request: str
    worst_adversary: Adversary | None
    failure: str | None = None
    failing_adversary: Adversary | None = None  # shrunk (``shrink``)
    outcomes: list[Outcome] = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool:
        return self.failure is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "options": self.options,
            "passed": self.passed,
            "examples": self.examples,
            "horizon_tokens": self.horizon_tokens,
            "worst_wait_tokens": self.worst_wait_tokens,
            "worst_wait_request": self.worst_wait_request,
            "worst_overtaken_tokens": self.worst_overtaken_tokens,
            "worst_overtaken_request": self.worst_overtaken_request,
            "worst_adversary": None
            if self.worst_adversary is None
            else asdict(self.worst_adversary),
            "failure": self.failure,
            "failing_adversary": None
            if self.failing_adversary is None
            else asdict(self.failing_adversary),
        }


# each knob's range: (low, high) for integers and floats (both ends included), a tuple of
# choices otherwise
KNOBS: dict[str, tuple[Any, ...]] = {
    "stream": (300, 600),
    "gap_ms": (5.0, 60.0),
    "stream_prompt": (32, 128),
    "stream_output": (1, 16),
    "hot_prefix": ((0, 64, 256, 512),),
    "stream_priority": ((-1, 0, 5),),
    "stream_tenants": (1, 64),
    "victims": (1, 3),
    "victim_prompt": (64, 1500),
    "victim_output": (1, 128),
    "victim_after": (1, 40),
    "seed": (0, 2**16),
}


def draw_adversary(rng: np.random.Generator) -> Adversary:
    """One adversary drawn uniformly over ``KNOBS`` (numpy's generator: the same draws for the
    same seed on any machine and in any process; hypothesis's draws mix in constants found in
    whatever modules are loaded, so they differed between a script and another context)."""
    values: dict[str, Any] = {}
    for name, knob in KNOBS.items():
        if len(knob) == 1:
            choices = knob[0]
            values[name] = choices[int(rng.integers(len(choices)))]
        elif isinstance(knob[0], float):
            values[name] = float(rng.uniform(knob[0], knob[1]))
        else:
            values[name] = int(rng.integers(knob[0], knob[1], endpoint=True))
    return Adversary(**values)


# the simplest value of each knob, for shrinking a failing adversary towards it; the stream's
# length, pace and prompt size are the pressure (the horizon the check looks within): kept
SIMPLEST: dict[str, Any] = {
    "stream_output": 1,
    "hot_prefix": 0,
    "stream_priority": 5,
    "stream_tenants": 1,
    "victims": 1,
    "victim_prompt": 64,
    "victim_output": 1,
    "victim_after": 1,
}


def shrink(adv: Adversary, fails: Callable[[Adversary], bool], runs: int) -> Adversary:
    """Greedily move each knob towards its simplest value (all the way, then halfway) while
    the adversary still fails, with at most ``runs`` simulations."""
    improved = True
    while improved and runs > 0:
        improved = False
        for name, simplest in SIMPLEST.items():
            current = getattr(adv, name)
            if current == simplest:
                continue
            halfway = type(current)((current + simplest) / 2)
            for value in dict.fromkeys((simplest, halfway)):
                if runs <= 0 or value == current:
                    continue
                runs -= 1
                candidate = replace(adv, **{name: value})
                if fails(candidate):
                    adv, improved = candidate, True
                    break
    return adv


def check_starvation(
    policy: str,
    options: dict[str, Any] | None = None,
    *,
    examples: int = 20,
    growth: float = 1.8,
    horizon_tokens: int | None = None,
    shrink_runs: int = 20,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    on_example: Callable[[Outcome], None] | None = None,
) -> StarvationReport:
    """Judge the default adversary and up to ``examples`` drawn ones (``draw_adversary``,
    seeded by ``seed``) under ``policy`` (a name, a composition or "pkg.module:Class"),
    stopping at the first failure, which is then shrunk with at most ``shrink_runs`` more
    judgements. The same arguments give the same report on any machine."""
    engine_config = EngineConfig.from_dict(
        {**CHECK_CONFIG, **(config or {}), "policy": policy, "policy_options": options or {}}
    )
    outcomes: list[Outcome] = []
    seen: dict[Adversary, Outcome] = {}

    def run(adv: Adversary) -> Outcome:
        if adv not in seen:
            outcome, problem = judge(engine_config, adv, growth, horizon_tokens)
            outcome.problem = problem
            seen[adv] = outcome
            outcomes.append(outcome)
            if on_example is not None:
                on_example(outcome)
        return seen[adv]

    def fails(adv: Adversary) -> bool:
        return run(adv).problem is not None

    failing: Adversary | None = Adversary(seed=seed)
    if not fails(failing):  # type: ignore[arg-type]
        failing = None
        rng = np.random.default_rng(seed)
        for _ in range(examples):
            adv = draw_adversary(rng)
            if fails(adv):
                failing = adv
                break
    report = StarvationReport(policy, dict(options or {}), 0, horizon_tokens, 0, "", 0, "", None)
    if failing is not None:
        failing = shrink(failing, fails, shrink_runs)
        report.failing_adversary = failing
        report.failure = run(failing).problem
    waits = max(outcomes, key=lambda o: o.worst_wait_tokens)
    overtaken = max(outcomes, key=lambda o: o.worst_overtaken_tokens)
    report.examples = len(outcomes)
    report.worst_wait_tokens = waits.worst_wait_tokens
    report.worst_wait_request = waits.worst_wait_request
    report.worst_overtaken_tokens = overtaken.worst_overtaken_tokens
    report.worst_overtaken_request = overtaken.worst_overtaken_request
    report.worst_adversary = overtaken.adversary
    report.outcomes = outcomes
    return report


__all__ = [
    "Adversary",
    "Outcome",
    "StarvationReport",
    "adversarial_workload",
    "check_starvation",
    "draw_adversary",
    "judge",
    "run_adversary",
    "shrink",
]
