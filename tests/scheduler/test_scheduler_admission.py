"""Admission: in-batch prefix dedup and the chunk bounding a whole step's prefill."""

from __future__ import annotations

import pytest

from asyncengine.common.plan import BatchPlan
from asyncengine.core.engine_core import EngineCore
from asyncengine.scheduler.step_prefixes import StepPrefixes
from tests.fake_executor import FakeExecutor, fake_core, reference_output
from tests.scheduler.test_scheduler import Clock, drive, submit

PAGE = 4


def make(
    policy: str = "fcfs", enable_prefix_cache: bool = True, **overrides: object
) -> tuple[EngineCore, FakeExecutor, Clock]:
    """In-step sharing (step_shares.py) off unless asked: these tests are of deferral."""
    overrides.setdefault("enable_in_step_prefix_sharing", False)
    clock = Clock()
    core, executor = fake_core(
        256,
        PAGE,
        1024,
        clock,
        policy=policy,
        enable_prefix_cache=enable_prefix_cache,
        **overrides,
    )
    return core, executor, clock


def step(core: EngineCore, runner: FakeExecutor) -> BatchPlan:
    plan = core.launch()
    assert plan is not None
    core.land(plan, runner.execute(plan))
    core.kv.check_invariant()
    return plan


SHARED = list(range(1, 2 * PAGE + 1))  # two whole pages, not cached at first


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_sibling_waits_a_step_and_hits_the_shared_pages(policy: str) -> None:
    core, runner, clock = make(policy)
    items = [(SHARED + [100, 101, 102], 3), (SHARED + [200, 201, 202], 3)]
    reqs = submit(core, clock, items)
    first = step(core, runner)
    assert len(first.extends) == 1  # one sibling computes the shared pages, the other waits
    later = {r.rid for r in reqs} - {first.extends[0].rid}
    plans = [first, *drive(core, runner, clock)]
    second = next(p for p in plans if any(s.rid in later for s in p.extends))
    (seg,) = [s for s in second.extends if s.rid in later]
    assert seg.start_pos == len(SHARED)  # only its own suffix is computed
    waited = next(r for r in reqs if r.rid in later)
    assert waited.cached_tokens == len(SHARED)
    assert core.kv.hit_tokens == len(SHARED)
    assert core.stats()["prefix_deferrals"] >= 1
    for req, (prompt, n) in zip(reqs, items, strict=True):
        assert req.output_ids == reference_output(prompt, n)


@pytest.mark.parametrize(
    "overrides",
    [
        {"enable_inbatch_prefix_dedup": False, "enable_in_step_prefix_sharing": False},
        {"enable_prefix_cache": False},
    ],
    ids=["dedup-off", "cache-off"],
)
def test_without_dedup_siblings_run_together_and_recompute(overrides: dict[str, bool]) -> None:
    core, runner, clock = make(**overrides)  # type: ignore[arg-type]
    reqs = submit(core, clock, [(SHARED + [100, 101, 102], 3), (SHARED + [200, 201, 202], 3)])
    assert len(step(core, runner).extends) == 2
    drive(core, runner, clock)
    assert [r.cached_tokens for r in reqs] == [0, 0]
    assert core.stats()["prefix_deferrals"] == 0


def test_without_dedup_siblings_share_the_pages_in_their_step() -> None:
    """In-step sharing (step_shares.py): the second sibling runs in the same step and copies
    the shared pages' KV from the first instead of computing them."""
    core, runner, clock = make(
        enable_inbatch_prefix_dedup=False, enable_in_step_prefix_sharing=True
    )
    items = [(SHARED + [100, 101, 102], 3), (SHARED + [200, 201, 202], 3)]
    reqs = submit(core, clock, items)
    plan = step(core, runner)
    assert [s.start_pos for s in plan.extends] == [0, len(SHARED)]
    assert len(plan.kv_copies) == len(SHARED)
    drive(core, runner, clock)
    assert [r.cached_tokens for r in reqs] == [0, len(SHARED)]
    assert core.stats()["prefix_deferrals"] == 0
    for req, (prompt, n) in zip(reqs, items, strict=True):
        assert req.output_ids == reference_output(prompt, n)


def test_deferral_skips_only_the_sibling_not_the_requests_behind_it() -> None:
    core, runner, clock = make()
    other = list(range(500, 511))
    reqs = submit(core, clock, [(SHARED + [100, 101], 2), (SHARED + [200, 201], 2), (other, 2)])
    assert {s.rid for s in step(core, runner).extends} == {reqs[0].rid, reqs[2].rid}
    plan = step(core, runner)
    assert [s.rid for s in plan.extends] == [reqs[1].rid]
    assert plan.extends[0].start_pos == len(SHARED)


def test_sharing_less_than_a_whole_uncached_page_is_not_deferred() -> None:
    core, runner, clock = make()
    head = SHARED[: PAGE - 1]  # three tokens: no page the cache could share
    submit(core, clock, [(head + [100] * 8, 2), (head + [200] * 8, 2)])
    assert len(step(core, runner).extends) == 2


def test_a_shared_last_page_the_cache_cannot_serve_is_not_deferred() -> None:
    # The second prompt is exactly the first shared page: the cache never serves a prompt's
    # last token, so it would compute that page anyway and has nothing to wait for.
    core, runner, clock = make()
    reqs = submit(core, clock, [(SHARED + [100, 101], 2), (SHARED[:PAGE], 2)])
    assert len(step(core, runner).extends) == 2
    drive(core, runner, clock)
    assert reqs[1].cached_tokens == 0


def test_sibling_of_a_chunked_prompt_waits_for_its_last_chunk() -> None:
    core, runner, clock = make(chunked_prefill_size=8, max_prefill_tokens=8)
    long_prompt = list(range(1, 21))  # chunks [0, 8), [8, 16), [16, 20)
    sibling = long_prompt + [99, 98, 97, 96, 95]  # shares all five pages of it
    reqs = submit(core, clock, [(long_prompt, 2), (sibling, 2)])
    plans = drive(core, runner, clock)
    last_chunk = next(p for p in plans if any(s.rid == "r0" and s.sample for s in p.extends))
    assert [s.rid for s in last_chunk.extends] == ["r0"]  # room for 4 more, but it waits
    assert reqs[1].cached_tokens == len(long_prompt)
    assert reqs[1].output_ids == reference_output(sibling, 2)


def test_a_sibling_copies_pages_computed_in_its_step_instead_of_waiting() -> None:
    """With in-step sharing on, dedup defers no prompt whose next page a segment of the step
    computes: it copies that page's KV in the same forward."""
    core, runner, clock = make(enable_in_step_prefix_sharing=True)
    items = [(SHARED + [100, 101, 102], 3), (SHARED + [200, 201, 202], 3)]
    reqs = submit(core, clock, items)
    assert len(step(core, runner).extends) == 2
    drive(core, runner, clock)
    assert [r.cached_tokens for r in reqs] == [0, len(SHARED)]
    assert core.stats()["prefix_deferrals"] == 0
    for req, (prompt, n) in zip(reqs, items, strict=True):
        assert req.output_ids == reference_output(prompt, n)


def test_tree_of_prompts_computes_every_shared_page_once() -> None:
    # Three levels of a tree, all queued at once: with dedup every page is computed once.
    root = list(range(1, 3 * PAGE + 1))
    prompts = []
    for a in range(3):
        child = root + [100 + a] * 2 * PAGE
        for b in range(3):
            prompts.append(child + [200 + b] * PAGE + [7])
    distinct_pages = {tuple(p[: i + PAGE]) for p in prompts for i in range(0, len(p) - 1, PAGE)}
    # (in-step sharing computes each once too, in fewer steps)
    for dedup, sharing, expect_once in [
        (True, False, True),
        (False, False, False),
        (False, True, True),
    ]:
        core, runner, clock = make(
            enable_inbatch_prefix_dedup=dedup, enable_in_step_prefix_sharing=sharing
        )
        reqs = submit(core, clock, [(p, 2) for p in prompts])
        drive(core, runner, clock)
        computed = sum(len(p) for p in prompts) - core.kv.hit_tokens
        once = len(distinct_pages) * PAGE + len(prompts)  # every page once, plus each last token
        assert (computed == once) is expect_once, (dedup, sharing, computed, once)
        for req, prompt in zip(reqs, prompts, strict=True):
            assert req.output_ids == reference_output(prompt, 2)


def test_step_prefixes_confirms_a_key_by_the_cached_head() -> None:
    prefixes = StepPrefixes(PAGE)
    page = [9, 9, 9, 9]
    prefixes.add([1, 2, 3, 4, *page, 5], computed=PAGE)
    # same length cached and the same next page, but behind another cached head
    assert not prefixes.shares([6, 6, 6, 6, *page, 7], matched=PAGE)
    assert prefixes.shares([1, 2, 3, 4, *page, 7], matched=PAGE)
    prefixes.clear()
    assert not prefixes.shares([1, 2, 3, 4, *page, 7], matched=PAGE)


# -- the chunk bounds the step ------------------------------------------------------------


def prefill_tokens(plan: BatchPlan) -> int:
    return sum(s.num_tokens for s in plan.extends)


def long_and_short_items() -> list[tuple[list[int], int]]:
    # A long prompt's last chunk leaves room that short prompts and the next long prompt's
    # first chunk would fill if only max_prefill_tokens bounded the step.
    longs = [list(range(1000 + 30 * i, 1030 + 30 * i)) for i in range(3)]
    shorts = [[2000 + 10 * i + k for k in range(3)] for i in range(6)]
    return [(longs[0], 3), *[(s, 3) for s in shorts[:3]], (longs[1], 3)] + [
        *[(s, 3) for s in shorts[3:]],
        (longs[2], 3),
    ]


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "dynamic-chunking"])
def test_chunk_size_bounds_a_steps_prefill(policy: str) -> None:
    options = {"min_chunk": PAGE} if policy == "dynamic-chunking" else {}
    core, runner, clock = make(
        policy, chunked_prefill_size=8, max_prefill_tokens=64, policy_options=options
    )
    items = long_and_short_items()
    reqs = submit(core, clock, items)
    plans = drive(core, runner, clock)
    assert prefill_tokens(plans[0]) == 8
    assert max(prefill_tokens(p) for p in plans) <= 8
    assert any(len(p.extends) > 1 for p in plans), "short prompts never shared a step"
    for req, (prompt, n) in zip(reqs, items, strict=True):
        assert req.output_ids == reference_output(prompt, n)


def test_a_policy_budget_below_the_chunk_still_bounds_the_step() -> None:
    core, runner, clock = make(
        "token-budget",
        chunked_prefill_size=16,
        max_prefill_tokens=64,
        policy_options={"prefill_tokens": 8, "total_tokens": 64},
    )
    submit(core, clock, long_and_short_items())
    plans = drive(core, runner, clock)
    assert max(prefill_tokens(p) for p in plans) == 8


def test_without_chunking_the_step_budget_is_max_prefill_tokens() -> None:
    core, runner, clock = make(chunked_prefill_size=0, max_prefill_tokens=64)
    submit(core, clock, [(list(range(1, 31)), 2), (list(range(100, 130)), 2)])
    assert prefill_tokens(step(core, runner)) == 60


def test_a_prompt_does_not_start_with_less_than_a_page() -> None:
    # 6 tokens of the 8-token step budget go to the first prompt; the 2 left are less than a
    # page, so the 9-token prompt starts next step with a whole-page chunk instead
    core, runner, clock = make(chunked_prefill_size=8, max_prefill_tokens=64)
    first, second = list(range(1, 7)), list(range(100, 109))
    reqs = submit(core, clock, [(first, 2), (second, 2)])
    plan = step(core, runner)
    assert [(s.rid, len(s.input_ids)) for s in plan.extends] == [(reqs[0].rid, len(first))]
    plans = drive(core, runner, clock)
    starts = [s for p in plans for s in p.extends if s.rid == reqs[1].rid]
    assert starts[0].start_pos == 0 and len(starts[0].input_ids) >= PAGE
    assert [r.output_ids for r in reqs] == [reference_output(first, 2), reference_output(second, 2)]


@pytest.mark.parametrize("skips", [0, 1])
def test_kv_blocked_skips_lets_a_small_request_pass_a_big_one(skips: int) -> None:
    core, executor, clock = make(kv_blocked_skips=skips)
    (running,) = submit(core, clock, [(list(range(1, 801)), 100)], tag="run")
    step(core, executor)  # the 800-token prompt holds most of the 256 pages now
    big, small = submit(core, clock, [(list(range(2000, 2400)), 4), (list(range(3000, 3008)), 4)])
    plan = step(core, executor)
    admitted = {seg.rid for seg in plan.extends}
    assert big.rid not in admitted  # 100 pages do not fit beside the running request
    assert (small.rid in admitted) == (skips > 0)
    blocked = core.scheduler.blocked(big)
    assert blocked == {"kv_reservation": 1}
    assert core.stats()["admission_blocked"]["kv_reservation"] == 1
    if skips:  # it passed the big one over and kept going: the big one keeps its place
        assert list(core.scheduler.waiting) == [big]
    else:
        assert list(core.scheduler.waiting) == [big, small]
        assert core.scheduler.blocked(small) == {"kv_reservation": 1}
