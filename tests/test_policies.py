"""Each policy's decisions on constructed cases."""

from __future__ import annotations

import pytest

from asyncengine.config import EngineConfig
from asyncengine.plan import BatchPlan, Segment
from asyncengine.request import Request
from asyncengine.sampling_params import SamplingParams
from policies import PolicyContext, make_policy
from policies.dynamic_chunking import DynamicChunkingPolicy


def req(rid: str, ids: list[int], arrival: float = 0.0) -> Request:
    return Request(rid, ids, SamplingParams(), arrival)


def ctx(
    prefix_len: dict[tuple[int, ...], int] | None = None, now: float = 0.0, **config: object
) -> PolicyContext:
    table = prefix_len or {}

    def lookup(ids: list[int]) -> int:
        return max((n for p, n in table.items() if tuple(ids[: len(p)]) == p), default=0)

    return PolicyContext(
        config=EngineConfig(**config),  # type: ignore[arg-type]
        now=now,
        num_running=0,
        num_decodes=0,
        prefix_len=lookup,
        chunked=None,
    )


def test_fcfs_keeps_arrival_order() -> None:
    waiting = [req("a", [1]), req("b", [2]), req("c", [3])]
    assert make_policy("fcfs").order(waiting, ctx()) == waiting


def test_lpm_prefers_longest_cached_prefix() -> None:
    waiting = [
        req("cold", [9, 9, 9], 0.0),
        req("warm", [1, 2, 3, 4], 0.0),
        req("hot", [5, 6, 7, 8], 0.0),
    ]
    order = make_policy("lpm").order(waiting, ctx({(1, 2): 32, (5, 6): 64}, now=0.1))
    assert [r.rid for r in order] == ["hot", "warm", "cold"]


def test_lpm_aging_serves_a_cold_request_eventually() -> None:
    cold = req("cold", [9, 9, 9], arrival=0.0)
    policy = make_policy("lpm", {"aging_tokens_per_second": 16.0, "max_wait_seconds": 1000.0})
    # a fresh hot request (64 cached tokens) goes first while the cold one has waited 2 s ...
    hot = req("hot", [5, 6, 7, 8], arrival=2.0)
    assert [r.rid for r in policy.order([cold, hot], ctx({(5, 6): 64}, now=2.0))] == ["hot", "cold"]
    # ... but after 5 s its aging term (16 tokens/s) beats the match of newly arrived hot requests
    hot = req("hot", [5, 6, 7, 8], arrival=5.0)
    assert [r.rid for r in policy.order([cold, hot], ctx({(5, 6): 64}, now=5.0))] == ["cold", "hot"]
    # the hard cap works whatever the match
    capped = make_policy("lpm", {"aging_tokens_per_second": 0.0, "max_wait_seconds": 5.0})
    assert [r.rid for r in capped.order([hot, cold], ctx({(5, 6): 10**6}, now=9.0))] == [
        "cold",
        "hot",
    ]


def test_dfs_weight_groups_siblings_heaviest_first() -> None:
    a, b = [1] * 16, [2] * 16
    waiting = [
        req("b1", b + [7] * 16, 0.0),
        req("a1", a + [3] * 16, 1.0),
        req("b2", b + [8] * 16, 2.0),
        req("a2", a + [4] * 16, 3.0),
        req("a3", a + [5] * 16, 4.0),
        req("b3", b + [9] * 16, 5.0),
        req("a4", a + [6] * 16, 6.0),
    ]
    order = [r.rid for r in make_policy("dfs-weight").order(waiting, ctx())]
    assert order == ["a1", "a2", "a3", "a4", "b1", "b2", "b3"]


def _plan(prefix: int, chunk: int) -> BatchPlan:
    plan = BatchPlan(step=0)
    plan.extends.append(Segment("x", 0, [1] * chunk, prefix, sample=False))
    return plan


def test_dynamic_chunking_follows_the_fitted_model() -> None:
    a, b, d = 2e-8, 1e-4, 1e-3  # seconds: attention, per-token, per-step
    policy = make_policy(
        "dynamic-chunking",
        {"base_chunk": 256, "min_chunk": 16, "max_chunk": 4096, "smoothing": 1.0},
    )
    assert isinstance(policy, DynamicChunkingPolicy)
    for prefix in (0, 256, 1024, 2048, 4096, 8192):
        for chunk in (64, 128, 256, 512):
            policy.observe(
                _plan(prefix, chunk), a * (2 * prefix * chunk + chunk * chunk) + b * chunk + d
            )
    assert policy.coef is not None
    assert policy.coef[0] == pytest.approx(a, rel=1e-3) and policy.coef[1] == pytest.approx(
        b, rel=1e-3
    )
    sizes = [policy.chunk_for_prefix(prefix, 256) for prefix in (0, 1000, 4000, 16000)]
    assert sizes[0] == pytest.approx(256, abs=1)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0] / 2
    target = a * 256 * 256 + b * 256
    for prefix, x in zip((1000, 4000, 16000), sizes[1:], strict=True):
        cost = a * (2 * prefix * x + x * x) + b * x
        assert cost == pytest.approx(target, rel=0.02)
    # the budget is clamped and page aligned
    context = ctx(page_size=16, chunked_prefill_size=256)
    budget = policy.budget(context)
    assert budget.chunk_size % 16 == 0 and 16 <= budget.chunk_size <= 4096


def test_dynamic_chunking_without_data_uses_the_base_chunk() -> None:
    policy = make_policy("dynamic-chunking", {"base_chunk": 128})
    assert policy.budget(ctx(page_size=16)).chunk_size == 128


def test_token_budget_bounds_prefill_and_total() -> None:
    budget = make_policy("token-budget", {"prefill_tokens": 100, "total_tokens": 150}).budget(ctx())
    assert budget.prefill_tokens == 100 and budget.total_tokens == 150 and budget.chunk_size <= 100
