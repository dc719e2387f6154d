"""The priority, sjf, fair and slo policies' decisions on constructed cases."""

from __future__ import annotations

import logging

import pytest

from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies import make_policy
from asyncengine.policies.fair import FairPolicy
from asyncengine.policies.lpm import LPMPolicy
from asyncengine.policies.priority import PriorityPolicy
from asyncengine.policies.sjf import SJFPolicy
from asyncengine.policies.slo import SLOPolicy
from tests.policies.test_policies import ctx


def req(rid: str, n: int = 4, arrival: float = 0.0, out: int = 16, **controls: object) -> Request:
    return Request(
        rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=out, **controls), arrival
    )  # type: ignore[arg-type]


def rids(requests: list[Request]) -> list[str]:
    return [r.rid for r in requests]


def prefill_plan(*segments: tuple[str, int, int], decodes: tuple[str, ...] = ()) -> BatchPlan:
    plan = BatchPlan(step=1)
    plan.extends = [Segment(rid, 0, [1] * n, start, sample=True) for rid, start, n in segments]
    plan.decodes = [Segment(rid, 0, [1], 10, sample=True) for rid in decodes]
    return plan


def test_priority_orders_by_priority_then_arrival_and_names_worse_victims() -> None:
    policy = make_policy("priority", {"preempt": True})
    waiting = [req("a", priority=2, arrival=0), req("b", priority=-1, arrival=1),
               req("c", priority=2, arrival=0.5), req("d", arrival=2)]  # fmt: skip
    assert rids(policy.order(waiting, ctx())) == ["b", "d", "a", "c"]
    running = [
        req("r1", priority=3),
        req("r2", priority=7),
        req("r3", priority=0),
        req("r4", priority=7),
    ]
    running[3].output_ids = [5] * 3  # more work done: retracted after r2
    victims = policy.preempt_candidates(req("new", priority=0), running, ctx())
    assert rids(victims) == ["r2", "r4", "r1"]  # worst first; never an equal priority
    assert policy.preempts and not make_policy("priority").preempts
    assert make_policy("priority").preempt_candidates(req("new"), running, ctx()) == []


def test_priority_wait_cap_puts_the_starving_first_in_arrival_order() -> None:
    policy = PriorityPolicy(max_wait_tokens=100)
    policy.prefill_rate.tokens, policy.prefill_rate.seconds = 100.0, 1.0  # 100 tokens/s
    waiting = [req("old-low", priority=9, arrival=0.0), req("older-low", priority=8, arrival=-0.5),
               req("new-high", priority=-5, arrival=1.9)]  # fmt: skip
    assert rids(policy.order(waiting, ctx(now=2.0))) == ["older-low", "old-low", "new-high"]


def test_lpm_wait_cap_puts_the_starving_first_in_arrival_order() -> None:
    policy = LPMPolicy(max_wait_tokens=100)
    policy.prefill_rate.tokens, policy.prefill_rate.seconds = 100.0, 1.0
    hot = list(range(1, 40))
    table = {tuple(hot[:32]): 32}
    waiting = [req("cold", 20, arrival=0.0), Request("hot", hot, SamplingParams(), 0.5),
               Request("hot-new", hot, SamplingParams(), 1.9)]  # fmt: skip
    # both "cold" and "hot" have waited 100+ tokens of work: by arrival, not by cached prefix
    assert rids(policy.order(waiting, ctx(table, now=2.0))) == ["cold", "hot", "hot-new"]


def test_sjf_orders_by_predicted_work_and_ages_long_jobs() -> None:
    policy = SJFPolicy(aging=1.0, max_wait_tokens=10_000)
    long, short = req("long", 200, arrival=0.0, out=100), req("short", 10, arrival=1.0, out=10)
    assert rids(policy.order([long, short], ctx(now=1.0))) == ["short", "long"]  # no rate yet
    cached = ctx({tuple(range(1, 191)): 190}, now=1.0)  # all but 10 of "long" cached: 110 left
    assert policy.job_tokens(long, cached) == 110
    policy.prefill_rate.tokens, policy.prefill_rate.seconds = 100.0, 1.0  # 100 tokens/s
    # "long" (300 tokens) waited 1 s more than "short" (20): 100 tokens of work, not enough
    assert rids(policy.order([long, short], ctx(now=2.0))) == ["short", "long"]
    # a short job that came 4.9 s after it (490 tokens of work) comes after it: the
    # 280-token difference is made up; the one that came 1 s after still goes first
    fresh = req("fresh", 10, arrival=4.9, out=10)
    assert rids(policy.order([long, fresh, short], ctx(now=5.0))) == ["short", "long", "fresh"]
    capped = SJFPolicy(aging=0.0, max_wait_tokens=150)
    capped.prefill_rate.tokens, capped.prefill_rate.seconds = 100.0, 1.0
    assert rids(capped.order([long, short], ctx(now=2.0))) == ["long", "short"]  # waited 200


def test_fair_serves_the_tenant_with_least_weighted_service_and_interleaves() -> None:
    policy = FairPolicy(weights={"gold": 2.0}, prefill_weight=1.0, decode_weight=2.0)
    a = [req(f"a{i}", 10, arrival=i, tenant="a") for i in range(3)]
    b = [req(f"b{i}", 10, arrival=10 + i, tenant="b") for i in range(2)]
    # equal service: the tenant with fewer requests in the engine first, then they interleave
    assert rids(policy.order(a + b, ctx())) == ["b0", "a0", "b1", "a1", "a2"]
    policy.observe(prefill_plan(("a0", 0, 10), ("a1", 0, 10)), 0.1)  # a got 20 tokens, b none
    assert policy.counters["a"] == 20.0
    assert rids(policy.order(a[2:] + b, ctx())) == ["b0", "b1", "a2"]
    # weights divide the charge: gold pays half per token
    policy.order([req("g0", 10, tenant="gold")], ctx())
    policy.observe(prefill_plan(("g0", 0, 10), decodes=("g0",)), 0.1)
    assert policy.counters["gold"] == pytest.approx(10 / 2 + 2 / 2)  # from the floor, 0


def test_fair_lifts_a_returning_tenant_to_the_active_floor() -> None:
    policy = FairPolicy()
    old = req("old", 10, tenant="quiet")
    policy.order([old], ctx())
    policy.observe(prefill_plan(("old", 0, 10)), 0.1)
    policy.finished(old)  # quiet leaves with 10 tokens of service
    busy = [req(f"busy{i}", 10, tenant="busy") for i in range(4)]
    policy.order(busy, ctx())
    policy.observe(prefill_plan(*[(f"busy{i}", 0, 10) for i in range(4)]), 0.1)
    assert policy.counters["busy"] == 40.0
    back = req("back", 10, tenant="quiet")
    policy.order([*busy, back], ctx())
    # it did not bank the 30 tokens it missed while idle: it starts level with "busy"
    assert policy.counters["quiet"] == 40.0


def test_fair_without_tenants_is_arrival_order() -> None:
    waiting = [req("x", arrival=1), req("y", arrival=2)]
    assert make_policy("fair").order(waiting, ctx()) == waiting


def fitted_slo(**options: object) -> SLOPolicy:
    policy = SLOPolicy(min_samples=4, **options)  # type: ignore[arg-type]
    # step = 1e-6 * attention + 1e-3 * tokens + 2e-3 * decodes + 10e-3
    for n, start, decodes in ((100, 0, 2), (200, 0, 5), (50, 100, 1), (300, 50, 8), (120, 0, 0)):
        plan = prefill_plan(("x", start, n), decodes=tuple(f"d{i}" for i in range(decodes)))
        seconds = 1e-6 * (2 * start * n + n * n) + 1e-3 * n + 2e-3 * decodes + 10e-3
        policy.observe(plan, seconds)
    assert policy.model.fitted
    return policy


def test_slo_orders_by_slack_against_the_ttft_target_late_ones_after() -> None:
    policy = fitted_slo(ttft_ms=500.0)
    # at t=1.0: "tight" is due at 1.05 (slack after ~0.3 s of prefill < 0: late), "soon" at
    # 1.3 with a short prompt, "later" at 1.45
    tight = req("tight", 300, arrival=0.55)
    soon = req("soon", 20, arrival=0.8)
    later = req("later", 20, arrival=0.95)
    assert rids(policy.order([later, tight, soon], ctx(now=1.0))) == ["soon", "later", "tight"]
    no_target = SLOPolicy()
    assert rids(no_target.order([later, soon], ctx(now=1.0))) == ["soon", "later"]  # arrival


def test_slo_budgets_prefill_to_keep_the_itl_target() -> None:
    policy = fitted_slo(itl_ms=100.0, min_chunk=16)
    context = ctx(page_size=16, chunked_prefill_size=1024, max_prefill_tokens=4096)
    context.num_decodes = 10
    budget = policy.budget(context)
    # 100 ms - (10 ms + 10 x 2 ms) = 70 ms of prefill: x^2 * 1e-6 + x * 1e-3 = 0.07 -> ~65
    assert budget.prefill_tokens == budget.chunk_size == 64
    context.num_decodes = 0  # nothing decodes: only TTFT matters, the config's budget
    assert policy.budget(context).prefill_tokens == 4096
    context.num_decodes = 60  # the decodes alone break the target: at least min_chunk
    assert policy.budget(context).prefill_tokens == 16


def test_slo_holds_new_requests_when_one_more_decode_would_break_itl() -> None:
    policy = fitted_slo(itl_ms=50.0)
    context = ctx(now=1.0)
    context.num_running = 25  # 10 ms + 26 x 2 ms = 62 ms > 50 ms
    waiting = [req("a", arrival=0.9), req("b", arrival=0.95)]
    assert policy.order(waiting, context) == []
    context.num_running = 10
    assert rids(policy.order(waiting, context)) == ["a", "b"]
    assert SLOPolicy(itl_ms=50.0, hold=False).order(waiting, context) == waiting


def test_slo_without_a_target_says_it_schedules_as_fcfs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncengine.policies"):
        SLOPolicy()
    assert "no target" in caplog.text and "configs/slo.toml" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncengine.policies"):
        SLOPolicy(itl_ms=100.0)
        SLOPolicy(ttft_ms=2000.0)
    assert caplog.text == ""


def test_compositions_forward_preemption_and_finished() -> None:
    composed = make_policy("priority+dynamic-chunking", {"priority": {"preempt": True}})
    assert composed.preempts
    running = [req("r", priority=5)]
    assert rids(composed.preempt_candidates(req("n", priority=0), running, ctx())) == ["r"]
    assert not make_policy("fcfs+dynamic-chunking").preempts
    fair = make_policy("fair+token-budget")
    r = req("t", tenant="x")
    fair.order([r, req("u", tenant="y")], ctx())
    fair.finished(r)
    assert fair.parts[0]._live["x"] == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("priority", {"preempt": 1}, "must be bool"),
        ("priority", {"max_wait_tokens": -1}, ">= 0"),
        ("sjf", {"aging": -1.0}, "aging"),
        ("fair", {"weights": {"a": 0}}, "weight of tenant 'a'"),
        ("fair", {"default_weight": 0.0}, "default_weight"),
        ("slo", {"ttft_ms": -5.0}, "ttft_ms"),
        ("slo", {"min_chunk": 0}, "min_chunk"),
        ("priority+slo", {}, "more than one ordering"),
    ],
)
def test_bad_options_are_refused(spec: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy(spec, options)


def test_fair_candidates_are_a_window_per_tenant() -> None:
    heavy = [req(f"h{i}", arrival=i, tenant="heavy") for i in range(6)]
    light = [req(f"l{i}", arrival=6 + i, tenant="light") for i in range(3)]
    waiting = [*heavy, light[0], req("h6", arrival=8, tenant="heavy"), *light[1:]]
    assert rids(make_policy("fcfs").candidates(waiting, 2)) == ["h0", "h1"]
    policy = FairPolicy()
    assert rids(policy.candidates(waiting, 2)) == ["h0", "h1", "l0", "l1"]
    assert rids(policy.candidates(waiting, 20)) == rids(waiting)
    assert policy.candidates(waiting, 20) is not waiting  # admission removes from the queue
    # served tenant "heavy" goes after "light", whose two oldest are both seen
    policy.order(policy.candidates(waiting, 2), ctx())
    policy.observe(prefill_plan(("h0", 0, 40)), 0.1)
    assert rids(policy.order(policy.candidates(waiting[1:], 2), ctx()))[:2] == ["l0", "l1"]
    composed = make_policy("fair+token-budget")
    assert rids(composed.candidates(waiting, 2)) == ["h0", "h1", "l0", "l1"]
