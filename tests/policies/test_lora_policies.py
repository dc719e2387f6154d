"""lora-fair (VTC per adapter) and lpm's adapter affinity, on constructed cases."""

from __future__ import annotations

import dataclasses

import pytest

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.policies import make_policy
from asyncengine.policies.base import PolicyContext
from asyncengine.policies.lora_fair import LoraFairPolicy
from asyncengine.policies.lpm import LPMPolicy
from asyncengine.policies.registry import build_policy
from tests.policies.test_policies import ctx
from tests.policies.test_policies_scheduling import prefill_plan, req, rids


def with_loras(context: PolicyContext, *loras: str) -> PolicyContext:
    return dataclasses.replace(context, step_loras=lambda: frozenset(loras))


def test_lora_fair_serves_the_least_served_adapter_first() -> None:
    policy = LoraFairPolicy()
    hot = [req(f"h{i}", 10, arrival=i, lora="hot") for i in range(4)]
    cold = req("c0", 10, arrival=10, lora="cold")
    base = req("b0", 10, arrival=11)
    # no service yet: the adapters with fewer requests first, then they interleave
    assert rids(policy.order([*hot, cold, base], ctx())) == ["c0", "b0", "h0", "h1", "h2", "h3"]
    policy.observe(prefill_plan(*[(f"h{i}", 0, 10) for i in range(4)]), 0.1)
    assert policy.counters["hot"] == 40.0 and policy.counters["cold"] == 0.0
    later = [req(f"h{i}", 10, arrival=20 + i, lora="hot") for i in range(4, 8)]
    # the flooding adapter's backlog goes after the others' requests, though older
    assert rids(policy.order([*later, cold, base], ctx()))[:2] == ["c0", "b0"]


def test_lora_fair_weights_and_tenants_are_not_its_clients() -> None:
    policy = make_policy("lora-fair", {"weights": {"gold": 4.0}})
    a = req("a", 8, lora="gold", tenant="t1")
    b = req("b", 8, lora="plain", tenant="t1")
    policy.order([a, b], ctx())
    policy.observe(prefill_plan(("a", 0, 8), ("b", 0, 8)), 0.1)
    assert policy.counters == {"gold": 2.0, "plain": 8.0}  # type: ignore[attr-defined]


def test_lora_fair_loads_by_name_composes_with_budgets_and_checks_options() -> None:
    composed = build_policy("lora-fair+token-budget", {"token-budget": {"prefill_tokens": 64}})
    assert composed.name == "lora-fair+token-budget"
    assert composed.budget(ctx()).prefill_tokens == 64
    with pytest.raises(ConfigError, match="lora-fair"):
        build_policy("lora-fair", {"default_weight": 0.0})
    with pytest.raises(ConfigError, match="unknown option"):
        build_policy("lora-fair", {"tenant_weights": {}})


def test_lpm_prefers_a_request_whose_adapter_is_in_the_step() -> None:
    policy = LPMPolicy()
    older = req("older", 8, arrival=0.0, lora="B")
    newer = req("newer", 8, arrival=1.0, lora="A")
    plain = req("plain", 8, arrival=0.5)
    context = with_loras(ctx(now=2.0), "A")
    assert rids(policy.order([older, plain, newer], context)) == ["newer", "older", "plain"]
    # nothing of theirs in the step: arrival order (no cached prefix either)
    assert rids(policy.order([older, plain, newer], ctx(now=2.0))) == ["older", "plain", "newer"]
    off = LPMPolicy(lora_affinity=0.0)
    assert rids(off.order([older, plain, newer], context)) == ["older", "plain", "newer"]


def test_lpm_affinity_is_bounded_by_aging() -> None:
    """The bonus is worth lora_affinity tokens: a request of another adapter that waited longer
    than that in prefill tokens (aging x rate x seconds) goes first, and the cap puts the
    starving first whatever the bonus."""
    policy = LPMPolicy(aging=1.0, lora_affinity=256.0)
    policy.prefill_rate.tokens, policy.prefill_rate.seconds = 100.0, 1.0  # 100 tokens/s
    waiting = req("waiting", 8, arrival=0.0, lora="B")
    fresh = req("fresh", 8, arrival=9.0, lora="A")
    assert rids(policy.order([waiting, fresh], with_loras(ctx(now=10.0), "A"))) == [
        "waiting",  # waited 1000 tokens' worth, more than the 256 + 100 of the other
        "fresh",
    ]
    early = req("early", 8, arrival=2.0, lora="A")
    # waiting has 250 tokens' worth at 2.5 s, early 50 + the bonus of 256: early first
    assert rids(policy.order([waiting, early], with_loras(ctx(now=2.5), "A"))) == [
        "early",
        "waiting",
    ]
    capped = LPMPolicy(aging=0.0, lora_affinity=1e9, max_wait_tokens=500)
    capped.prefill_rate.tokens, capped.prefill_rate.seconds = 100.0, 1.0
    young = req("young", 8, arrival=9.0, lora="A")
    assert rids(capped.order([waiting, young], with_loras(ctx(now=10.0), "A"))) == [
        "waiting",
        "young",
    ]


def test_lpm_rejects_a_negative_affinity() -> None:
    with pytest.raises(ValueError, match="lora_affinity"):
        LPMPolicy(lora_affinity=-1.0)
    assert EngineConfig(policy="lpm", policy_options={"lora_affinity": 32.0}).policy == "lpm"


def test_lora_fair_evens_the_running_batch_for_an_adapter_back_from_idle() -> None:
    """An adapter coming back starts at the flood's counter, within ``preempt_margin`` of it:
    it may still have the flood's least computed requests retracted, down to the flood's share
    of max_running_requests and to no fewer than its own, and the flood cannot take them back
    that way."""
    policy = LoraFairPolicy()
    context = ctx(max_running_requests=6)  # two adapters with requests: three each
    running = [req(f"h{i}", 10, arrival=i, lora="hot") for i in range(6)]
    for i, r in enumerate(running):
        r.output_ids = [7] * (10 - i)  # h5 has generated the least
    policy.order(running, context)
    policy.observe(prefill_plan(*[(r.rid, 0, 10) for r in running]), 0.1)
    cold = req("c0", 10, arrival=10, lora="cold")
    policy.order([cold], context)
    assert policy.counters["cold"] == policy.counters["hot"]  # lifted to the active floor
    assert rids(policy.preempt_candidates(cold, running, context)) == ["h5", "h4", "h3"]
    # the cold adapter running two of its own: two more of the flood's even them
    mine = [req(f"c{i}", 10, arrival=10 + i, lora="cold") for i in (1, 2)]
    policy.order(mine, context)
    assert rids(policy.preempt_candidates(cold, [*running, *mine], context)) == ["h5", "h4"]
    # at its share, it takes none
    third = req("c3", 10, arrival=13, lora="cold")
    policy.order([third], context)
    assert policy.preempt_candidates(cold, [*running, *mine, third], context) == []
    # the flood's waiting request names none of the cold adapter's (it runs more than they do)
    late = req("h9", 10, arrival=20, lora="hot")
    policy.order([late], context)
    assert policy.preempt_candidates(late, [*running[:1], *mine, third], context) == []
    # nor when the cold adapter runs over its share, while it has been served less
    more = [req(f"c{i}", 10, arrival=20 + i, lora="cold") for i in (4, 5)]
    policy.order(more, context)
    batch = [*running[:1], *mine, third, *more]
    policy.observe(prefill_plan(decodes=("h0",)), 0.1)
    assert policy.preempt_candidates(late, batch, context) == []
    policy.observe(prefill_plan(("c1", 0, 100)), 0.1)  # served more now: down to its share
    assert rids(policy.preempt_candidates(late, batch, context)) == ["c5", "c4"]
    off = LoraFairPolicy(preempt_for_share=False)
    off.order([*running, cold], context)
    assert off.preempt_candidates(cold, running, context) == []


def test_lora_fair_breaks_a_tie_for_the_adapter_with_fewer_requests() -> None:
    """An adapter back from idle is lifted to the flood's counter; at that tie its request goes
    before the flood's older backlog, not a step behind it."""
    policy = LoraFairPolicy()
    flood = [req(f"h{i}", 10, arrival=i, lora="hot") for i in range(4)]
    policy.order(flood, ctx())
    policy.observe(prefill_plan(("h0", 0, 10)), 0.1)
    cold = req("c0", 10, arrival=10, lora="cold")
    ordered = rids(policy.order([*flood[1:], cold], ctx()))
    assert policy.counters["cold"] == policy.counters["hot"]
    assert ordered == ["c0", "h1", "h2", "h3"]
