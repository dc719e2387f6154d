"""A policy's hook that raises, or answers what the scheduler cannot act on, costs the engine
only the policy: the step goes on as FCFS would, the failure is logged and counted, FCFS takes
over from the next step, every request still ends with the right tokens and the KV invariant
holds at every step; a failing shadow policy is dropped and changes nothing."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from tests.fake_executor import reference_output
from tests.scheduler.test_preemption import short_core
from tests.scheduler.test_scheduler import drive, submit, workload

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


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ("RaisesInOrder", "boom in order"),
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
