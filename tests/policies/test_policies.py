"""Each policy's decisions on constructed cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asyncengine.cache.manager import KVCacheManager
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies import PolicyContext, make_policy
from asyncengine.policies.dynamic_chunking import DynamicChunkingPolicy
from asyncengine.policies.lpm import LPMPolicy
from asyncengine.policies.prefill_rate import PrefillRate


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


def cached_ctx(*prompts: list[int]) -> PolicyContext:
    """A context whose prefix lengths come from a real KV cache (page 16) holding ``prompts``."""
    kv = KVCacheManager(num_pages=64, page_size=16, max_rows=4, max_pages_per_row=16)
    for prompt in prompts:
        seq = kv.open(prompt)
        kv.extend(seq, len(prompt) - seq.kv_len)
        kv.close(seq, prompt)
    context = ctx()
    context.prefix_len = kv.match_length
    return context


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


def prefill_step(tokens: int) -> BatchPlan:
    plan = BatchPlan(step=0)
    plan.extends.append(Segment("p", 0, [1] * tokens, 0, sample=True))
    return plan


def lpm_on_a_machine(prefill_tokens_per_second: float, **options: object) -> LPMPolicy:
    """An LPM policy that has watched one step prefill at the given speed."""
    policy = make_policy("lpm", options)
    assert isinstance(policy, LPMPolicy)
    policy.observe(prefill_step(1024), 1024 / prefill_tokens_per_second)
    return policy


def test_lpm_aging_serves_a_cold_request_eventually() -> None:
    policy = lpm_on_a_machine(1000.0, aging=0.01, max_wait_tokens=10**9)
    cold = req("cold", [9, 9, 9], arrival=0.0)
    # a fresh hot request (64 cached tokens) goes first while the cold one has waited 2 s
    # (2,000 prefilled tokens' worth: 20 tokens of priority) ...
    hot = req("hot", [5, 6, 7, 8], arrival=2.0)
    assert [r.rid for r in policy.order([cold, hot], ctx({(5, 6): 64}, now=2.0))] == ["hot", "cold"]
    # ... but after 10 s its aging term (100 tokens) beats the match of newly arrived hot ones
    hot = req("hot", [5, 6, 7, 8], arrival=10.0)
    assert [r.rid for r in policy.order([cold, hot], ctx({(5, 6): 64}, now=10.0))] == [
        "cold",
        "hot",
    ]
    # the hard cap works whatever the match: 9 s at 1,000 tokens/s is past 5,000 tokens
    capped = lpm_on_a_machine(1000.0, aging=0.0, max_wait_tokens=5000)
    assert [r.rid for r in capped.order([hot, cold], ctx({(5, 6): 10**6}, now=9.0))] == [
        "cold",
        "hot",
    ]


@pytest.mark.parametrize("waited_tokens", [2_000, 10_000, 40_000])
def test_lpm_aging_is_the_same_on_a_slow_and_a_fast_machine(waited_tokens: int) -> None:
    """Waits scale with the machine's speed: a request that waited 100x longer on a machine
    that prefills 100x slower is in the same position, so it must rank the same."""
    decisions = []
    for rate in (200.0, 20_000.0):
        policy = lpm_on_a_machine(rate, aging=0.01, max_wait_tokens=30_000)
        now = waited_tokens / rate
        cold = req("cold", [9, 9, 9], arrival=0.0)
        warm = req("warm", [1, 2, 3], arrival=now / 2)
        hot = req("hot", [5, 6, 7, 8], arrival=now)
        table = {(5, 6): 10**6, (1, 2): 32}
        order = policy.order([cold, warm, hot], ctx(table, now=now))
        decisions.append([r.rid for r in order])
    assert decisions[0] == decisions[1]
    expected = {
        2_000: ["hot", "warm", "cold"],  # aging 20 tokens (warm 10 + 32): the matches decide
        10_000: ["hot", "cold", "warm"],  # cold's aging (100) passes warm's 50 + 32
        40_000: ["cold", "hot", "warm"],  # the cap: past 30,000 tokens waited, first
    }
    assert decisions[0] == expected[waited_tokens]


def test_lpm_without_a_measured_rate_orders_by_match_alone() -> None:
    policy = make_policy("lpm")
    cold = req("cold", [9, 9, 9], arrival=0.0)
    hot = req("hot", [5, 6, 7, 8], arrival=10**6)
    assert [r.rid for r in policy.order([cold, hot], ctx({(5, 6): 16}, now=10**6))] == [
        "hot",
        "cold",
    ]


def test_prefill_rate_counts_prefill_steps_and_fades_old_ones() -> None:
    rate = PrefillRate(decay=0.5)
    assert rate.tokens_per_second == 0.0
    rate.add(prefill_step(1000), 1.0)
    assert rate.tokens_per_second == pytest.approx(1000.0)
    rate.add(BatchPlan(step=1), 5.0)  # no prefill: not counted
    assert rate.tokens_per_second == pytest.approx(1000.0)
    rate.add(prefill_step(1000), 0.25)  # the machine got faster
    assert rate.tokens_per_second == pytest.approx((500 + 1000) / (0.5 + 0.25))


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


def test_dfs_weight_finishes_a_cached_group_before_a_heavier_fresh_one() -> None:
    """Half of group a was served, so its prefix is cached: its last two members go before
    the four of group b, which would evict that prefix in a small pool."""
    a, b = [1] * 32, [2] * 32
    waiting = [
        req("b1", b + [5] * 8),
        req("a1", a + [3] * 8),
        req("b2", b + [6] * 8),
        req("b3", b + [7] * 8),
        req("a2", a + [4] * 8),
        req("b4", b + [8] * 8),
    ]
    order = make_policy("dfs-weight").order(waiting, cached_ctx(a))
    assert [r.rid for r in order] == ["a1", "a2", "b1", "b2", "b3", "b4"]
    # with nothing cached the heavier group goes first, as before
    order = make_policy("dfs-weight").order(waiting, ctx())
    assert [r.rid for r in order] == ["b1", "b2", "b3", "b4", "a1", "a2"]


def test_dfs_weight_goes_down_the_cached_branch_first() -> None:
    """Below a cached prefix, the child whose next block is cached too goes first, even when a
    sibling has more waiting requests below it."""
    root, hot, cold = [1] * 16, [2] * 16, [3] * 16
    waiting = [
        req("cold1", root + cold + [4] * 16),
        req("cold2", root + cold + [5] * 16),
        req("cold3", root + cold + [6] * 16),
        req("hot1", root + hot + [7] * 16),
        req("other", [8] * 48),
    ]
    order = make_policy("dfs-weight").order(waiting, cached_ctx(root + hot + [9] * 16))
    assert [r.rid for r in order] == ["hot1", "cold1", "cold2", "cold3", "other"]


def test_dfs_weight_breaks_ties_by_queue_position() -> None:
    """Equal groups and equal arrival times (a burst): the oldest in the queue goes first."""
    waiting = [req(f"r{i}", [i] * 20) for i in range(5)]
    order = make_policy("dfs-weight").order(waiting, ctx())
    assert [r.rid for r in order] == ["r0", "r1", "r2", "r3", "r4"]


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
    assert policy.model.coef is not None
    assert policy.model.coef[0] == pytest.approx(a, rel=1e-3) and policy.model.coef[
        1
    ] == pytest.approx(b, rel=1e-3)
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


@pytest.mark.parametrize(("a", "b"), [(2e-8, 1e-4), (1e-12, 3e-5), (3e-9, 7e-6), (1e-7, 1e-4)])
def test_dynamic_chunking_gives_exactly_the_base_chunk_at_prefix_zero(a: float, b: float) -> None:
    """Rounding once made these 63, 127, 511, 4095: a page less once page aligned."""
    policy = make_policy("dynamic-chunking")
    assert isinstance(policy, DynamicChunkingPolicy)
    policy.model.coef = np.array([a, b, 0.0, 1e-3])
    for base in (64, 128, 500, 512, 1000, 4096):
        assert policy.chunk_for_prefix(0, base) == base
    assert policy.budget(ctx(page_size=16, chunked_prefill_size=512)).chunk_size == 512


def test_dynamic_chunking_in_the_scheduler_shrinks_chunks_then_grows_them_back() -> None:
    """Step times follow a*(2*l*x + x^2) + b*x + d: once fitted, each chunk of a long prompt is
    the longest page-aligned one that costs no more than a base chunk at prefix 0, so chunks
    shrink as the prefix grows; the next prompt starts again at the base chunk."""
    from tests.scheduler.test_scheduler import drive, make_scheduler, submit

    a, b, d, page, base = 1e-7, 1e-4, 1e-3, 4, 64

    def cost(prefix: int, tokens: int) -> float:
        return a * (2 * prefix * tokens + tokens * tokens) + b * tokens

    sched, runner, clock = make_scheduler(
        num_pages=1024,
        page_size=page,
        policy="dynamic-chunking",
        chunked_prefill_size=base,
        max_prefill_tokens=base,
        policy_options={"base_chunk": base, "min_chunk": page, "smoothing": 1.0},
    )
    execute = runner.execute

    def timed(plan: BatchPlan):  # type: ignore[no-untyped-def]
        output = execute(plan)
        output.forward_seconds = sum(cost(s.start_pos, s.num_tokens) for s in plan.extends) + d
        return output

    runner.execute = timed  # type: ignore[method-assign]
    submit(sched, clock, [(list(range(1 + 300 * i, 301 + 300 * i)), 2) for i in range(3)], "w")
    drive(sched, runner, clock)
    policy = sched.policy
    assert isinstance(policy, DynamicChunkingPolicy) and policy.model.coef is not None
    assert policy.model.coef[:2] == pytest.approx([a, b], rel=1e-3)
    target = cost(0, base)
    for tag, first in (("long", 2000), ("next", 5000)):
        prompt = list(range(first, first + (1200 if tag == "long" else 400)))
        submit(sched, clock, [(prompt, 2)], tag)
        plans = drive(sched, runner, clock)
        chunks = [(s.start_pos, s.num_tokens) for p in plans for s in p.extends]
        assert chunks[0] == (0, base)  # a fresh prompt starts at the base chunk again
        sizes = [n for _, n in chunks]
        assert sizes[:-1] == sorted(sizes[:-1], reverse=True)
        for prefix, n in chunks[:-1]:
            assert n % page == 0
            assert cost(prefix, n) <= target * 1.01 and cost(prefix, n + page) > target * 0.99
        if tag == "long":
            assert sizes[-2] < base / 2


def test_a_user_policy_from_its_own_file_orders_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy of one's own is one class in one file (the README's example, as written there),
    named "module:Class" in the config, and composes with a built-in budget."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = readme.split("```python\n")[1:]
    (example,) = [b.split("```")[0] for b in blocks if "class ShortestPromptFirst" in b]
    (tmp_path / "shortest_first.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in (
        "shortest_first:ShortestPromptFirst",
        "shortest_first:ShortestPromptFirst+token-budget",
    ):
        assert EngineConfig(policy=spec).policy == spec
        assert_starts_shortest_first(spec)


def assert_starts_shortest_first(spec: str) -> None:
    """Under ``spec``, one request at a time, prompts of 9, 3, 6 and 4 tokens start shortest
    first."""
    from tests.scheduler.test_scheduler import drive, make_scheduler, submit

    sched, runner, clock = make_scheduler(
        policy=spec, chunked_prefill_size=0, max_prefill_tokens=12, max_running_requests=1
    )
    lengths = [9, 3, 6, 4]
    reqs = submit(sched, clock, [([100 * i + 1] * n, 1) for i, n in enumerate(lengths)])
    plans = drive(sched, runner, clock)
    started = [s.rid for p in plans for s in p.extends]
    assert started == [r.rid for r in sorted(reqs, key=lambda r: len(r.prompt_ids))]
