"""LPM's shortcut for a window where nothing is cached: its order is the scored one.

When every waiting request's cached prefix is 0, ``LPMPolicy.order`` sorts by arrival instead
of scoring each request (policies/lpm.py). The documented rule, written out here as keys
(starving first, then -(cached + aging x rate x waited), then arrival, then place), must give
the same order: out-of-order windows, equal arrivals, starving requests, no rate yet, and a
window where one request does match (the scored path). The same window asked again with
nothing cached since (``PolicyContext.cache_epoch``) gets the order it got.
"""

from __future__ import annotations

import random

import pytest

from asyncengine.cache.manager import KVCacheManager
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies import PolicyContext, make_policy
from asyncengine.policies.lpm import LPMPolicy

PAGE = 16


def _reference(policy: LPMPolicy, waiting: list[Request], ctx: PolicyContext) -> list[str]:
    rate = policy.prefill_rate.tokens_per_second
    keys = []
    for index, req in enumerate(waiting):
        waited = ctx.now - req.arrival_time
        starving = waited * rate >= policy.max_wait_tokens
        cached = ctx.prefix_len(req.all_ids)
        score = 0.0 if starving else -(cached + policy.aging * rate * waited)
        keys.append((not starving, score, req.arrival_time, index))
    return [waiting[key[3]].rid for key in sorted(keys)]


def _ctx(kv: KVCacheManager, now: float) -> PolicyContext:
    return PolicyContext(
        config=EngineConfig(),
        now=now,
        num_running=0,
        num_decodes=0,
        prefix_len=kv.match_length,
        chunked=None,
        prefix_epoch=kv.prefix_epoch,
        cache_epoch=kv.cache_epoch(),
    )


def _observe_rate(policy: LPMPolicy, tokens: int, seconds: float) -> None:
    plan = BatchPlan(step=1)
    plan.extends.append(Segment("x", 0, [1] * tokens, 0, sample=False))
    policy.observe(plan, seconds)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rate", [None, (4000, 1.0), (4000, 0.001)])
def test_order_matches_the_scores(seed: int, rate: tuple[int, float] | None) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(num_pages=64, page_size=PAGE, max_rows=4, max_pages_per_row=16)
    policy = make_policy("lpm", {"max_wait_tokens": 50_000})
    assert isinstance(policy, LPMPolicy)
    if rate is not None:
        _observe_rate(policy, *rate)
    cached_prompt = [7] + list(range(1000, 1000 + 3 * PAGE))
    if seed % 2:  # one request's prompt is in the cache: the scored path
        seq = kv.open(cached_prompt)
        kv.extend(seq, len(cached_prompt))
        kv.close(seq, cached_prompt)
    waiting = []
    for i in range(40):
        arrival = float(rng.choice([0.0, 1.0, 2.5, rng.uniform(0, 100)]))  # ties included
        prompt = (
            cached_prompt if i == 17 else [100 + i] + [rng.randrange(50_000) for _ in range(40)]
        )
        waiting.append(Request(f"r{i}", prompt, SamplingParams(), arrival))
    rng.shuffle(waiting)
    for now in (100.0, 130.0):
        ctx = _ctx(kv, now)
        expected = _reference(policy, waiting, ctx)
        assert [r.rid for r in policy.order(waiting, ctx)] == expected
        assert [r.rid for r in policy.order(waiting, ctx)] == expected  # with the memo kept


def test_the_same_window_keeps_its_order_until_something_is_cached() -> None:
    kv = KVCacheManager(num_pages=64, page_size=PAGE, max_rows=4, max_pages_per_row=16)
    policy = make_policy("lpm")
    assert isinstance(policy, LPMPolicy)
    _observe_rate(policy, 10, 1.0)  # a second waited weighs 0.1 token: a match goes first
    prompts = [[200 + i] + list(range(300 * i, 300 * i + 3 * PAGE)) for i in range(6)]
    waiting = [Request(f"r{i}", p, SamplingParams(), float(5 - i)) for i, p in enumerate(prompts)]
    first = policy.order(waiting, _ctx(kv, 10.0))
    assert [r.rid for r in first] == ["r5", "r4", "r3", "r2", "r1", "r0"]
    again = policy.order(waiting, _ctx(kv, 11.0))
    assert again == first and again is not first
    shorter = waiting[1:]  # another window: ordered anew
    assert [r.rid for r in policy.order(shorter, _ctx(kv, 11.0))] == ["r5", "r4", "r3", "r2", "r1"]
    seq = kv.open(prompts[2])  # r2's prompt is cached: the same window, another order
    kv.extend(seq, len(prompts[2]))
    kv.close(seq, prompts[2])
    ctx = _ctx(kv, 12.0)
    assert [r.rid for r in policy.order(waiting, ctx)] == _reference(policy, waiting, ctx)
    assert policy.order(waiting, ctx)[0].rid == "r2"
