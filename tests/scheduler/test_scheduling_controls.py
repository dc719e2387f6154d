"""Request-level controls in the engine core, over the model-free executor: timeouts, queue
time limits, priority preemption, live policy swaps and shadow policies. Outputs are exact and
the KV invariant is checked after every step."""

from __future__ import annotations

import pytest

from asyncengine.common.request import Request, RequestStatus
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.core.engine_core import EngineCore
from asyncengine.policies.base import Policy, PolicyContext
from asyncengine.scheduler.admission import (
    POLICY_HOLD,
    POLICY_WINDOW,
    PREFIX_DEDUP,
    Admission,
    AdmissionLog,
)
from asyncengine.scheduler.step_events import StepEvents
from tests.fake_executor import FakeExecutor, fake_core, reference_output
from tests.scheduler.test_scheduler import Clock


class HoldOdd(Policy):
    """Orders only the requests whose id ends in an even digit (the others are held), until
    none of those is left."""

    name = "hold-odd"
    orders = True

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        even = [r for r in waiting if int(r.rid[-1]) % 2 == 0]
        return even or waiting


class Newest(Policy):
    """Newest first, and nothing at all when one request waits (a shadow that disagrees)."""

    name = "newest"
    orders = True

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return waiting[::-1] if len(waiting) > 1 else []


def make(
    num_pages: int = 256, page_size: int = 4, **overrides: object
) -> tuple[EngineCore, FakeExecutor, Clock]:
    clock = Clock()
    core, executor = fake_core(num_pages, page_size, 1024, clock, **overrides)
    core.step_hooks.append(lambda plan: core.check_invariant())
    return core, executor, clock


def add(
    core: EngineCore, clock: Clock, rid: str, prompt: list[int], n: int, **params: object
) -> Request:
    req = Request(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0, **params), clock())  # type: ignore[arg-type]
    core.add(req)
    return req


def step(core: EngineCore, clock: Clock) -> StepEvents:
    result = core.step()
    assert result is not None
    clock.t += result.forward_seconds
    return result


def run(core: EngineCore, clock: Clock, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not core.has_work():
            break
        result = core.step()
        if result is None:
            assert not core.has_work(), "work is waiting but nothing could be scheduled"
            break
        clock.t += result.forward_seconds
    assert not core.has_work()
    stats = core.kv.stats()
    assert stats["pages_used"] == 0, stats
    assert (
        stats["pages_free"] + stats["pages_cached"] + stats["pages_tail"] == stats["pages_total"]
    ), stats


def test_the_new_sampling_params_are_checked() -> None:
    for bad in ({"priority": 1.5}, {"priority": True}, {"timeout": 0}, {"timeout": float("inf")}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="tenant"):
        SamplingParams(tenant="")
    params = SamplingParams(priority=-3, timeout=2, tenant="acme")
    assert (params.priority, params.timeout, params.tenant) == (-3, 2, "acme")


def test_a_running_request_times_out_frees_its_pages_and_keeps_its_prefix_cached() -> None:
    core, executor, clock = make()
    prompt = list(range(1, 18))  # four whole pages and one token
    slow = add(core, clock, "slow", prompt, 50, timeout=0.1)
    other = add(core, clock, "other", [7, 8, 9], 40)
    while slow.first_token_time is None:
        step(core, clock)
    assert core.kv.stats()["pages_used"] > 0
    clock.t = 0.1  # its deadline
    result = core.step()
    assert result is not None and result.expired == [slow]
    assert slow.finish_reason == "timeout" and slow.finished and slow.seq is None
    assert all(seg.rid != "slow" for seg in result.plan.segments)
    assert core.kv.match_length(prompt + [1]) == 16  # its computed pages stay cached
    assert core.counters["finished_timeout"] == 1
    assert core.stats()["tenants"][""]["finished_timeout"] == 1
    run(core, clock)
    assert other.output_ids == reference_output([7, 8, 9], 40)  # the others are untouched


def test_a_waiting_request_times_out_without_ever_running() -> None:
    core, executor, clock = make(max_running_requests=1)
    first = add(core, clock, "first", [1, 2, 3], 30)
    late = add(core, clock, "late", [4, 5, 6], 5, timeout=0.01)
    step(core, clock)
    clock.t = 1.0
    events = step(core, clock)
    assert late.finish_reason == "timeout" and late.first_scheduled_time is None
    assert late.output_ids == [] and events.expired == [late] and late in events.ended
    run(core, clock)
    assert first.output_ids == reference_output([1, 2, 3], 30)


def test_max_queue_time_only_bounds_the_wait_before_first_scheduling() -> None:
    core, executor, clock = make(max_running_requests=1, max_queue_time=0.5)
    first = add(core, clock, "first", [1, 2, 3], 8)
    second = add(core, clock, "second", [4, 5, 6], 8)
    step(core, clock)  # first is scheduled: its queue limit no longer applies
    clock.t = 0.6
    run(core, clock)
    assert first.finish_reason == "length"
    assert first.output_ids == reference_output([1, 2, 3], 8)
    assert second.finish_reason == "timeout" and second.output_ids == []


def test_admission_blocks_are_counted_per_step_and_per_request() -> None:
    core, executor, clock = make(
        max_running_requests=2, chunked_prefill_size=8, max_prefill_tokens=8
    )
    reqs = [add(core, clock, f"r{i}", [10 * i + j for j in range(1, 7)], 4) for i in range(1, 5)]
    step(core, clock)  # r1 (6 tokens) fits the 8-token budget; r2's first page would not
    blocked = core.stats()["admission_blocked"]
    assert blocked["token_budget"] == 1 and sum(blocked.values()) == 1
    assert [core.scheduler.blocked(r) for r in reqs] == [
        {},
        {"token_budget": 1},
        {"token_budget": 1},
        {"token_budget": 1},
    ]
    step(core, clock)  # r2 joins: two running, the cap
    step(core, clock)
    assert core.stats()["admission_blocked"]["running_cap"] >= 1
    assert core.scheduler.blocked(reqs[3]).get("running_cap", 0) >= 1
    run(core, clock)
    for i, req in enumerate(reqs, start=1):
        assert req.output_ids == reference_output([10 * i + j for j in range(1, 7)], 4)


def test_a_chunk_in_flight_and_the_policy_window_are_reasons_too() -> None:
    core, executor, clock = make(chunked_prefill_size=8, max_prefill_tokens=64)
    add(core, clock, "a", [1, 2], 2)
    long = add(core, clock, "long", list(range(10, 39)), 2)
    c = add(core, clock, "c", [900, 901], 2)
    step(core, clock)  # a (2 tokens), then a page of long: budget left, but long is mid-chunk
    assert long.status is RequestStatus.PREFILLING and core.scheduler.chunked is long
    assert core.scheduler.blocked(c) == {"chunk_in_flight": 1}
    assert core.stats()["admission_blocked"]["chunk_in_flight"] == 1
    run(core, clock)
    assert long.output_ids == reference_output(list(range(10, 39)), 2)

    # a queue longer than the window: the one beyond it waits for "policy_window"
    core, executor, clock = make(policy_window=1)
    a = add(core, clock, "a", [1, 2, 3], 1)
    b = add(core, clock, "b", [4, 5, 6], 1)
    step(core, clock)
    assert a.status is not RequestStatus.WAITING and core.scheduler.blocked(b) == {
        "policy_window": 1
    }
    assert core.stats()["admission_blocked"]["policy_window"] == 1
    run(core, clock)


def test_in_batch_dedup_and_a_policy_hold_are_counted() -> None:
    core, executor, clock = make(enable_in_step_prefix_sharing=False)  # else it copies them now
    shared = list(range(1, 9))  # two whole pages
    first = add(core, clock, "first", shared + [50], 2)
    sibling = add(core, clock, "sibling", shared + [60], 2)
    step(core, clock)
    assert first.status is not RequestStatus.WAITING
    assert core.scheduler.blocked(sibling) == {"prefix_dedup": 1}
    assert core.stats()["admission_blocked"]["prefix_dedup"] == 1
    run(core, clock)

    # a policy that leaves a request out of its order holds it
    core2, executor2, clock2 = make(policy="tests.scheduler.test_scheduling_controls:HoldOdd")
    kept = add(core2, clock2, "kept0", [1, 2, 3], 2)
    held = add(core2, clock2, "held1", [4, 5, 6], 2)
    step(core2, clock2)
    assert kept.status is not RequestStatus.WAITING and core2.scheduler.blocked(held) == {
        "policy_hold": 1
    }
    assert core2.stats()["admission_blocked"]["policy_hold"] == 1


def test_with_mixed_batches_off_a_decode_step_is_a_reason() -> None:
    core, executor, clock = make(enable_mixed_batch=False, max_consecutive_prefill_steps=1)
    add(core, clock, "a", [1, 2, 3], 10)
    step(core, clock)  # a's prefill
    b = add(core, clock, "b", [4, 5, 6], 3)
    step(core, clock)  # a decode step is due: b waits
    assert core.scheduler.blocked(b) == {"decode_turn": 1}
    run(core, clock)


def test_priority_orders_by_priority_then_arrival() -> None:
    core, executor, clock = make(policy="priority", max_running_requests=1)
    add(core, clock, "first", [1, 2, 3], 2)
    low = add(core, clock, "low", [4, 5, 6], 2, priority=5)
    high = add(core, clock, "high", [7, 8, 9], 2, priority=-1)
    same = add(core, clock, "same", [10, 11, 12], 2, priority=-1)
    run(core, clock)
    assert high.first_scheduled_time < same.first_scheduled_time < low.first_scheduled_time  # type: ignore[operator]


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("blocker", ["slots", "memory"])
def test_priority_preemption_retracts_a_worse_request_and_never_re_emits(
    mixed: bool, blocker: str
) -> None:
    limits: dict[str, object] = (
        {"max_running_requests": 2} if blocker == "slots" else {"max_running_requests": 8}
    )
    num_pages = 64 if blocker == "slots" else 14
    core, executor, clock = make(
        num_pages,
        policy="priority",
        policy_options={"preempt": True},
        enable_mixed_batch=mixed,
        **limits,
    )
    prompts = {"low0": [1, 2, 3, 4, 5], "low1": [6, 7, 8, 9, 10], "vip": [11, 12, 13, 14, 15]}
    lows = [add(core, clock, rid, prompts[rid], 20, priority=3) for rid in ("low0", "low1")]
    for _ in range(4):
        step(core, clock)
    assert all(r.status is RequestStatus.RUNNING for r in lows)
    vip = add(core, clock, "vip", prompts["vip"], 20, priority=0)
    step(core, clock)
    assert vip.status is not RequestStatus.WAITING, "the better request did not get in"
    assert core.stats()["preemptions"] >= 1
    victims = [r for r in lows if r.retractions]
    assert victims and all(r.status is RequestStatus.WAITING for r in victims)
    run(core, clock)
    for req in [*lows, vip]:
        assert req.output_ids == reference_output(prompts[req.rid], 20), req.rid


def test_equal_priorities_never_preempt_and_preemption_is_off_by_default() -> None:
    for options, priority in (({"preempt": True}, 3), ({}, 0)):
        core, executor, clock = make(
            policy="priority", policy_options=options, max_running_requests=1
        )
        add(core, clock, "a", [1, 2, 3], 10, priority=3)
        step(core, clock)
        add(core, clock, "b", [4, 5, 6], 10, priority=priority)
        run(core, clock)
        assert core.stats()["preemptions"] == 0


def test_no_preemption_when_the_victims_would_not_make_room() -> None:
    # 16 pages: "mid" (as good as the newcomer: never a victim) holds most of them, "low" few
    core, executor, clock = make(16, policy="priority", policy_options={"preempt": True})
    mid = add(core, clock, "mid", list(range(1, 31)), 8, priority=0)
    low = add(core, clock, "low", [40, 41, 42], 8, priority=9)
    for _ in range(3):
        step(core, clock)
    assert mid.status is RequestStatus.RUNNING and low.status is RequestStatus.RUNNING
    vip = add(core, clock, "vip", list(range(100, 130)), 2, priority=0)
    step(core, clock)
    assert vip.status is RequestStatus.WAITING
    assert low.retractions == 0 and core.stats()["preemptions"] == 0
    run(core, clock)
    assert vip.output_ids == reference_output(list(range(100, 130)), 2)


def test_a_policy_swap_takes_over_at_the_next_step_and_leaks_nothing() -> None:
    core, executor, clock = make(num_pages=40, chunked_prefill_size=8)
    prompts = [[i * 7 % 997 + 1 for i in range(k, k + 11 + k % 9)] for k in range(12)]
    reqs = [add(core, clock, f"r{k}", p, 6 + k % 5, priority=-k) for k, p in enumerate(prompts)]
    for _ in range(3):
        step(core, clock)
    assert core.set_policy("lpm") == "fcfs"
    # a pending swap replaced before it ran: it is the one replaced (what GET showed)
    assert core.set_policy("priority+dynamic-chunking", {"priority": {"preempt": True}}) == "lpm"
    assert core.policy.name == "fcfs"  # not before the step boundary
    step(core, clock)
    assert core.policy.name == "priority+dynamic-chunking"
    assert core.config.policy == "priority+dynamic-chunking"
    assert core.stats()["policy_swaps"] == 2
    run(core, clock)
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output_ids == reference_output(prompt, req.params.max_new_tokens)


def test_a_bad_policy_swap_changes_nothing() -> None:
    core, executor, clock = make()
    with pytest.raises(ValueError, match="unknown policy"):
        core.set_policy("no-such-policy")
    with pytest.raises(ValueError, match="unknown option"):
        core.set_policy("priority", {"bogus": 1})
    assert core.config.policy == "fcfs" and core.scheduler._next_policy is None


@pytest.mark.parametrize("shadow", ["fcfs", "lpm", "sjf", "priority"])
def test_a_shadow_policy_never_changes_what_runs(shadow: str) -> None:
    def trace(**overrides: object) -> tuple[list[list[int]], list[tuple[int, ...]], EngineCore]:
        core, executor, clock = make(num_pages=48, chunked_prefill_size=8, **overrides)
        shared = list(range(1, 13))
        reqs = [
            add(core, clock, f"r{k}", (shared if k % 2 else []) + [100 + k] * (3 + k), 4 + k % 3)
            for k in range(10)
        ]
        plans = []
        while core.has_work():
            result = core.step()
            assert result is not None
            clock.t += result.forward_seconds
            plans.append(
                tuple(hash((s.rid, s.start_pos, s.num_tokens)) for s in result.plan.segments)
            )
        return [r.output_ids for r in reqs], plans, core

    outputs, plans, _ = trace(policy="lpm")
    shadowed_outputs, shadowed_plans, core = trace(policy="lpm", shadow_policy=shadow)
    assert (shadowed_outputs, shadowed_plans) == (outputs, plans)
    stats = core.stats()["shadow"]
    assert stats["policy"] == shadow and stats["decisions"] > 0
    assert 0.0 <= stats["first_pick_agreement"] <= 1.0
    assert 0.0 <= stats["top_k_agreement"] <= 1.0


def test_a_shadow_of_the_same_policy_always_agrees_and_a_reversed_one_rarely() -> None:
    for shadow, expected in (
        ("fcfs", 1.0),
        ("tests.scheduler.test_scheduling_controls:Newest", 0.0),
    ):
        core, executor, clock = make(policy="fcfs", shadow_policy=shadow, max_running_requests=1)
        for k in range(6):
            add(core, clock, f"r{k}", [k + 1, k + 2, k + 3], 3)
        run(core, clock)
        stats = core.stats()["shadow"]
        assert stats["decisions"] >= 4
        assert stats["first_pick_agreement"] == expected


class EagerLog(AdmissionLog):
    """The reference: every waiting request counted every step (what the lazy log must equal)."""

    def arrived(self, req: Request, front: bool = False) -> None:
        return None

    def left(self, req: Request) -> None:
        return None

    def settle(self, req: Request) -> dict[str, int]:
        return req.blocked

    def record(self, waiting: list[Request], admission: Admission) -> None:
        if not waiting:
            return
        in_window = {id(r) for r in admission.window}
        outside = sum(1 for r in waiting if id(r) not in in_window)
        stopped, beyond = admission.stopped, admission.stopped or POLICY_WINDOW
        if stopped is None:
            if admission.held:
                stopped = POLICY_HOLD
            elif outside:
                stopped = POLICY_WINDOW
            elif admission.deferred:
                stopped = PREFIX_DEDUP
            else:
                return
        self.steps[stopped] += 1
        special = {id(r): PREFIX_DEDUP for r in admission.deferred}
        special.update((id(r), POLICY_HOLD) for r in admission.held)
        for r in waiting:
            reason = special.get(id(r)) or (stopped if id(r) in in_window else beyond)
            r.blocked[reason] = r.blocked.get(reason, 0) + 1


LAZY_CASES = {
    "priority-preempt": {"policy": "priority", "policy_options": {"preempt": True}},
    "no-mixed": {"policy": "fcfs", "enable_mixed_batch": False},
    "hold-odd": {"policy": "tests.scheduler.test_scheduling_controls:HoldOdd"},
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(LAZY_CASES))
def test_lazy_admission_counts_equal_counting_every_request_every_step(
    seed: int, case: str
) -> None:
    import random

    def simulate(log: AdmissionLog) -> tuple[list[dict[str, int]], dict[str, int], int]:
        rng = random.Random(seed)
        core, executor, clock = make(
            num_pages=26,
            policy_window=3,
            max_running_requests=6,
            chunked_prefill_size=48,
            init_new_token_ratio=0.05,
            min_new_token_ratio=0.01,
            **LAZY_CASES[case],  # type: ignore[arg-type]
        )
        core.scheduler.admission = log
        reqs = []
        for k in range(40):
            if rng.random() < 0.6:
                shared = [7, 7, 7, 7, 8, 8, 8, 8] if rng.random() < 0.5 else []
                ids = shared + [rng.randrange(1, 999) for _ in range(rng.randrange(2, 20))]
                n, priority = rng.randrange(2, 40), rng.randrange(3)
                reqs.append(add(core, clock, f"r{k}", ids, n, priority=priority))
            if rng.random() < 0.1 and reqs:
                core.abort(rng.choice(reqs).rid)
            if core.has_work():
                step(core, clock)
        run(core, clock)
        counts = [core.scheduler.blocked(r) for r in reqs]
        return counts, dict(core.stats()["admission_blocked"]), core.stats()["retractions"]

    lazy = simulate(AdmissionLog())
    eager = simulate(EagerLog())
    assert lazy == eager
    assert lazy[2] > 0  # retracted requests went to the queue's front
    reasons = {reason for counts in lazy[0] for reason in counts}
    assert {"policy_window", "kv_reservation"} <= reasons, reasons
