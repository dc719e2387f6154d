"""A policy's hook that raises, or answers what the scheduler cannot act on, costs the engine
only the policy: the step goes on as FCFS would, the failure is logged and counted, FCFS takes
over from the next step, every request still ends with the right tokens and the KV invariant
holds at every step; a failing shadow policy is dropped and changes nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import pytest

from asyncengine.cache.pins import Pin
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.engine_core import EngineCore
from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from asyncengine.scheduler.policy_guard import SLOW_HOOK_SECONDS, PolicyStalledError
from asyncengine.sim.workload_replay import held_retry
from tests.api.test_scheduling_e2e import engine, params, prompt, until
from tests.fake_executor import reference_output
from tests.scheduler.test_preemption import short_core
from tests.scheduler.test_scheduler import Clock, drive, submit, workload

HERE = "tests.scheduler.test_policy_guard"


class RaisesInOrder(Policy):
    name = "raises-in-order"
    calls = 0

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        type(self).calls += 1
        if type(self).calls == 3:
            raise RuntimeError("boom in order")
        return list(reversed(waiting))


class NamesAStrangerInOrder(Policy):
    name = "orders-a-stranger"

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return [*waiting, Request("stranger", [1], SamplingParams(), 0.0)]


class OrdersTwice(Policy):
    name = "orders-twice"

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return waiting + waiting[:1]


class NegativeBudget(Policy):
    name = "negative-budget"

    def budget(self, ctx: PolicyContext) -> StepBudget:
        return StepBudget(-5, -5, -1)


class FloatBudget(Policy):
    name = "float-budget"

    def budget(self, ctx: PolicyContext) -> StepBudget:
        return StepBudget(24.5, None, 8)  # type: ignore[arg-type]


class RaisesInFinished(Policy):
    name = "raises-in-finished"

    def finished(self, req: Request) -> None:
        raise KeyError(req.rid)


class RaisesInPreempt(Policy):
    name = "raises-in-preempt"

    def preempt_candidates(
        self, candidate: Request | None, running: Sequence[Request], ctx: PolicyContext
    ) -> list[Request]:
        raise RuntimeError("boom in preempt_candidates")


class OrdersIntoATuple(Policy):
    name = "orders-into-a-tuple"

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return tuple(waiting)  # type: ignore[return-value]


class CandidatesInATuple(Policy):
    name = "candidates-in-a-tuple"

    def candidates(self, waiting: Sequence[Request], size: int) -> list[Request]:
        return tuple(waiting[:size])  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ("RaisesInOrder", "boom in order"),
        # the guard's words, not a type error of the compiled scheduler's call
        ("OrdersIntoATuple", "order() returned tuple, not a list"),
        ("CandidatesInATuple", "candidates() returned tuple, not a list"),
        ("NamesAStrangerInOrder", "stranger"),
        ("OrdersTwice", "twice"),
        ("NegativeBudget", "prefill_tokens is -5"),
        ("FloatBudget", "prefill_tokens is 24.5"),
        ("RaisesInFinished", "KeyError"),
        ("RaisesInPreempt", "boom in preempt_candidates"),
    ],
)
def test_a_failing_hook_costs_only_the_policy(
    policy: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    RaisesInOrder.calls = 0
    core, runner, clock = short_core(policy=f"{HERE}:{policy}")
    reqs = submit(core, clock, workload(seed=5, n=24, max_out=48))
    drive(core, runner, clock)  # every request ends, the KV invariant held at every step
    for req in reqs:
        assert req.output_ids == reference_output(req.prompt_ids, len(req.output_ids))
        assert len(req.output_ids) == req.params.max_new_tokens
    scheduler = core.scheduler
    assert scheduler.policy.name == "fcfs" and scheduler.policy_failures >= 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # once, with the traceback
    message = errors[0].getMessage() + str(errors[0].exc_info[1] if errors[0].exc_info else "")
    assert says in message or says in str(errors[0].exc_info), message
    assert core.stats()["policy_failures"] == scheduler.policy_failures


def test_a_failing_shadow_is_dropped_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    RaisesInOrder.calls = 0
    plain, plain_runner, plain_clock = short_core()
    shadowed, runner, clock = short_core(shadow_policy=f"{HERE}:RaisesInOrder")
    items = workload(seed=6, n=24, max_out=48)
    want = submit(plain, plain_clock, items)
    got = submit(shadowed, clock, items)
    plans = drive(plain, plain_runner, plain_clock)
    shadow_plans = drive(shadowed, runner, clock)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert len(shadow_plans) == len(plans)
    assert shadowed.scheduler.shadow is None and shadowed.scheduler.policy.name == "fcfs"
    assert any("shadow policy" in r.getMessage() for r in caplog.records)


class ZeroBudget(Policy):
    name = "zero-budget"

    def budget(self, ctx: PolicyContext) -> StepBudget:
        return StepBudget(0, 0, 0)


async def test_a_policy_that_stalls_a_live_engine_hands_over_to_fcfs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing runs, requests wait and the policy admits nothing: after max_policy_stall
    seconds of that the engine logs it once and FCFS serves them, instead of a silent hang."""
    async with engine(policy=f"{HERE}:ZeroBudget", max_policy_stall=0.05) as eng:
        outs = await asyncio.gather(
            *(eng.generate(prompt(k), params(3), request_id=f"r{k}") for k in range(3))
        )
        stats = eng.stats()
    assert [out.finish_reason for out in outs] == ["length"] * 3
    assert stats["policy"] == "fcfs" and stats["policy_failures"] == 1
    assert stats["policy_idle_holds"] >= 1 and stats["policy_idle_seconds"] >= 0.05
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "policy 'zero-budget' stalled" in errors[0], errors
    assert "admitted nothing for" in errors[0] and "'r0'" in errors[0]


class HoldsLowPriority(Policy):
    """Holds every request of priority > 0 until ``released``, asking to be woken ``ahead``
    seconds on (a pacing window that ends only when the test says so); the others go at once."""

    name = "holds-low-priority"
    orders = True

    def __init__(self, ahead: float = 0.5) -> None:
        self.ahead = ahead
        self.released = False

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return [req for req in waiting if self.released or req.params.priority == 0]

    def wake_time(self, ctx: PolicyContext) -> float | None:
        return ctx.now + self.ahead


async def test_a_live_engine_sleeps_until_a_holding_policy_wakes_instead_of_polling() -> None:
    """A policy that holds with a wake time 0.5 s ahead is asked again at that time, not every
    2 ms: a tenth of a second of holding is one idle step, not fifty; held and released, the
    request is served at its next wake."""
    async with engine(policy=f"{HERE}:HoldsLowPriority") as eng:
        held = asyncio.create_task(
            eng.generate(prompt(0), params(3, priority=1), request_id="held")
        )
        await until(lambda: eng.stats()["policy_idle_holds"] >= 1)
        steps = eng.scheduler.step_count
        await asyncio.sleep(0.1)  # a loop polling every 2 ms holds ~50 times meanwhile
        stats = eng.stats()
        assert stats["policy_idle_holds"] <= 2, stats  # 2: the sleep overran the wake time
        assert eng.scheduler.step_count - steps <= 1 and not held.done()
        eng.scheduler.policy.released = True  # type: ignore[attr-defined]
        out = await asyncio.wait_for(held, 30)
        stats = eng.stats()
    assert out.finish_reason == "length" and stats["policy_failures"] == 0
    assert 1 <= stats["policy_idle_holds"] <= 4, stats
    assert stats["policy_idle_seconds"] > 0


async def test_an_arrival_or_a_swap_wakes_a_loop_sleeping_until_a_far_wake_time() -> None:
    """The loop sleeps until the holding policy's wake time (an hour ahead here), but new work
    wakes it at once: an arrival the policy admits is served while the held one waits, and a
    swap to FCFS serves the held one, both long before the wake time."""
    async with engine(
        policy=f"{HERE}:HoldsLowPriority", policy_options={"ahead": 3600.0}, max_policy_stall=0
    ) as eng:
        held = asyncio.create_task(
            eng.generate(prompt(0), params(3, priority=1), request_id="held")
        )
        await until(lambda: eng.stats()["policy_idle_holds"] >= 1)
        urgent = await asyncio.wait_for(eng.generate(prompt(1), params(3), request_id="u"), 30)
        assert urgent.finish_reason == "length" and not held.done()
        eng.set_policy("fcfs")
        out = await asyncio.wait_for(held, 30)
        stats = eng.stats()
    assert out.finish_reason == "length" and stats["policy"] == "fcfs"
    assert stats["policy_idle_holds"] <= 3, stats


class SlowAtFirst(Policy):
    """Its first order() and budget() calls take longer than SLOW_HOOK_SECONDS."""

    name = "slow-at-first"

    def __init__(self) -> None:
        self.slow_orders = self.slow_budgets = 1

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        if self.slow_orders:
            self.slow_orders -= 1
            time.sleep(SLOW_HOOK_SECONDS * 1.2)
        return waiting

    def budget(self, ctx: PolicyContext) -> StepBudget:
        if self.slow_budgets:
            self.slow_budgets -= 1
            time.sleep(SLOW_HOOK_SECONDS * 1.2)
        return Policy.budget(self, ctx)


def test_a_slow_hook_is_reported_once_and_the_policy_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core, runner, clock = short_core(policy=f"{HERE}:SlowAtFirst")
    reqs = submit(core, clock, workload(seed=7, n=8, max_out=8))
    drive(core, runner, clock)
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings  # the budget's slow call, then no other for this policy
    assert "policy 'slow-at-first': a call of budget() took" in warnings[0]
    assert "event loop" in warnings[0]
    assert core.scheduler.policy.name == "slow-at-first" and core.stats()["policy_failures"] == 0


class WakesAtAWord(Policy):
    name = "wakes-at-a-word"

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return []

    def wake_time(self, ctx: PolicyContext) -> float | None:
        return "soon"  # type: ignore[return-value]


def test_a_wake_time_of_the_wrong_type_is_named_as_such(caplog: pytest.LogCaptureFixture) -> None:
    core, _, clock = short_core(policy=f"{HERE}:WakesAtAWord")
    submit(core, clock, [([1, 2, 3], 2)])
    assert core.launch() is None
    core.held_until()
    assert core.stats()["policy_failures"] == 1
    assert "wake_time() returned 'soon', not a time or None" in caplog.text


def test_holds_stall_only_while_nothing_runs_and_a_stall_ends_when_the_queue_empties() -> None:
    core, _, clock = short_core(policy=f"{HERE}:ZeroBudget", max_policy_stall=10.0)
    submit(core, clock, [([1, 2, 3], 2)])
    assert core.launch() is None
    clock.t += 4.0
    assert core.launch() is None
    assert core.stats()["policy_idle_holds"] == 2
    assert core.abort("r0")
    core.events()
    clock.t += 100.0  # nothing waits: no stall goes on meanwhile
    submit(core, clock, [([1, 2, 3], 2)], tag="s")
    assert core.launch() is None  # a new stall, not one 104 s old
    stats = core.stats()
    assert stats["policy_failures"] == 0 and stats["policy"] == "zero-budget"
    assert stats["policy_idle_seconds"] == 4.0


def pinned_pool(policy: str, simulated: bool) -> tuple[EngineCore, Clock, Pin]:
    """A core whose 40-page pool has 36 pages pinned and a request waiting whose first chunk
    (16 pages) does not fit in the rest: admission is blocked by KV memory whatever the policy
    answers; ``simulated``: a stall raises, as in the simulator. ``policy`` takes over once the
    pinned prefix is cached."""
    core, runner, clock = short_core(
        max_pinned_fraction=0.9,
        chunked_prefill_size=64,
        max_prefill_tokens=64,
        max_policy_stall=10.0,
    )
    core.scheduler.stall_raises = simulated
    system = list(range(1, 145))
    submit(core, clock, [(system, 1)], tag="warm")
    drive(core, runner, clock)
    pin = core.pin(system)
    core.set_policy(policy)
    submit(core, clock, [(list(range(500, 600)), 2)])
    return core, clock, pin


@pytest.mark.parametrize("simulated", [False, True], ids=["engine", "simulator"])
def test_a_pool_blocked_by_pins_is_not_blamed_on_the_policy(
    simulated: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing runs for longer than max_policy_stall because pinned prefixes fill the pool:
    no hold is counted, the policy neither fails over to FCFS nor is raised against, and one
    warning names what blocks admission; unpinned, the request runs."""
    core, clock, pin = pinned_pool("lpm", simulated)
    for _ in range(4):  # 18 s of steps that run nothing
        assert core.launch() is None
        assert held_retry(core, clock(), more_to_arrive=False) is None  # not held by the policy
        clock.t += 6.0
    stats = core.stats()
    assert stats["policy"] == "lpm" and stats["policy_failures"] == 0
    assert stats["policy_idle_holds"] == 0 and stats["policy_idle_seconds"] == 0.0
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1, said
    assert "blocked by kv_reservation, not by policy 'lpm' (36 of 40 KV pages" in said[0]
    core.unpin(pin.pin_id)
    plan = core.launch()
    assert plan is not None and [seg.rid for seg in plan.extends] == ["r0"]


@pytest.mark.parametrize("simulated", [False, True], ids=["engine", "simulator"])
def test_a_policy_that_holds_over_a_blocked_pool_still_stalls(
    simulated: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The same pinned pool under a policy whose budget lets nothing in: the policy held, so
    past max_policy_stall it is a stall, as anywhere else."""
    core, clock, _ = pinned_pool(f"{HERE}:ZeroBudget", simulated)
    assert core.launch() is None
    clock.t += 10.0
    if simulated:
        with pytest.raises(PolicyStalledError, match="'zero-budget' admitted nothing"):
            core.launch()
        return
    assert core.launch() is None
    stats = core.stats()
    assert stats["policy_failures"] == 1 and stats["policy_idle_holds"] == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "policy 'zero-budget' stalled" in errors[0], errors
