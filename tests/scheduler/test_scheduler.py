"""Scheduler behaviour over a model-free executor: exact outputs, KV invariant every step."""

from __future__ import annotations

import random

import pytest

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request, RequestStatus
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.engine_core import EngineCore
from asyncengine.policies import BUILTIN
from tests.fake_executor import FakeExecutor, fake_core, reference_output


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_scheduler(
    num_pages: int = 256,
    page_size: int = 4,
    policy: str = "fcfs",
    max_model_len: int = 4096,
    **overrides: object,
) -> tuple[EngineCore, FakeExecutor, Clock]:
    clock = Clock()
    core, executor = fake_core(
        num_pages, page_size, max_model_len, clock, policy=policy, **overrides
    )
    return core, executor, clock


def drive(
    core: EngineCore, runner: FakeExecutor, clock: Clock, max_steps: int = 5000
) -> list[BatchPlan]:
    plans = []
    for _ in range(max_steps):
        if not core.has_work():
            break
        plan = core.launch()
        assert plan is not None, "work is waiting but nothing could be scheduled"
        plans.append(plan)
        output = runner.execute(plan)
        clock.t += output.forward_seconds
        core.land(plan, output)
        core.kv.check_invariant()
    assert not core.has_work(), "requests left unfinished"
    stats = core.kv.stats()
    assert stats["pages_used"] == 0, stats
    assert (
        stats["pages_free"] + stats["pages_cached"] + stats["pages_tail"] == stats["pages_total"]
    ), stats
    return plans


def workload(seed: int, n: int, shared: int = 3, max_out: int = 24) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(1, 1000) for _ in range(rng.randrange(5, 60))] for _ in range(shared)
    ]
    out = []
    for _ in range(n):
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 80))]
        out.append((prompt, rng.randrange(1, max_out)))
    return out


def step(core: EngineCore, runner: FakeExecutor, clock: Clock) -> BatchPlan:
    """One step that runs something, landed, the KV invariant checked."""
    plan = core.launch()
    assert plan is not None
    output = runner.execute(plan)
    clock.t += output.forward_seconds
    core.land(plan, output)
    core.kv.check_invariant()
    return plan


def submit(
    core: EngineCore, clock: Clock, items: list[tuple[list[int], int]], tag: str = "r"
) -> list[Request]:
    reqs = []
    for i, (prompt, n) in enumerate(items):
        req = Request(f"{tag}{i}", prompt, SamplingParams(max_new_tokens=n, temperature=0), clock())
        core.add(req)
        reqs.append(req)
    return reqs


POLICIES = [*sorted(BUILTIN), "lpm+dynamic-chunking", "dfs-weight+token-budget"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mixed", [True, False])
def test_outputs_exact_under_chunking_and_retract(policy: str, mixed: bool) -> None:
    # 40 pages of 4 tokens: far less than the 24 requests need at once, so decode must retract
    core, runner, clock = make_scheduler(
        num_pages=40,
        page_size=4,
        policy=policy,
        chunked_prefill_size=8,
        max_prefill_tokens=24,
        enable_mixed_batch=mixed,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.01,
    )  # an optimistic reservation admits more than fits later: decode has to retract
    items = workload(seed=1, n=24, max_out=64)
    reqs = submit(core, clock, items)
    plans = drive(core, runner, clock)
    for req, (prompt, n) in zip(reqs, items, strict=True):
        assert req.output_ids == reference_output(prompt, n), req.rid
        assert req.finish_reason == "length"
    assert core.scheduler.retraction.total_retractions > 0
    assert any(not s.sample for p in plans for s in p.extends), "no prompt was chunked"
    assert all(sum(1 for s in p.extends if not s.sample) <= 1 for p in plans), (
        "two requests mid-chunk"
    )
    if mixed:
        assert any(p.extends and p.decodes for p in plans), "no mixed batch"
    else:
        assert not any(p.extends and p.decodes for p in plans)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_sharing_hits_cache(page_size: int) -> None:
    core, runner, clock = make_scheduler(num_pages=4096 // page_size, page_size=page_size)
    system = list(range(1, 65))
    items = [(system + [100 + i, 200 + i], 4) for i in range(6)]
    submit(core, clock, items[:1])
    drive(core, runner, clock)
    reqs = submit(core, clock, items[1:], tag="later")
    drive(core, runner, clock)
    for req, (prompt, n) in zip(reqs, items[1:], strict=True):
        assert req.output_ids == reference_output(prompt, n)
        assert req.cached_tokens == 64
    assert core.kv.stats()["hit_tokens"] >= 5 * 64


def test_mid_chunk_request_goes_first_and_samples_only_at_the_end() -> None:
    core, runner, clock = make_scheduler(
        chunked_prefill_size=8, max_prefill_tokens=8, short_prompt_tokens=0
    )
    long_prompt = list(range(1, 41))
    submit(core, clock, [(long_prompt, 3), ([5, 6, 7], 3)])
    plans = drive(core, runner, clock)
    firsts = [p.extends[0] for p in plans if p.extends][:5]
    assert [s.rid for s in firsts] == ["r0"] * 5
    assert [s.sample for s in firsts] == [False] * 4 + [True]


def test_max_consecutive_prefill_steps_lets_decodes_run() -> None:
    core, runner, clock = make_scheduler(
        enable_mixed_batch=False,
        chunked_prefill_size=4,
        max_prefill_tokens=4,
        max_consecutive_prefill_steps=2,
    )
    submit(core, clock, [([1, 2, 3], 30)])
    for _ in range(3):
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
    submit(core, clock, [(list(range(1, 200)), 2)], tag="long")
    kinds = []
    for _ in range(9):
        plan = core.launch()
        assert plan is not None
        kinds.append("P" if plan.extends else "D")
        core.land(plan, runner.execute(plan))
    assert "PPP" not in "".join(kinds), kinds
    assert "D" in kinds and "P" in kinds


def test_abort_at_random_moments_leaks_nothing_and_keeps_others_exact() -> None:
    rng = random.Random(7)
    core, runner, clock = make_scheduler(
        num_pages=64, page_size=4, chunked_prefill_size=8, max_prefill_tokens=16
    )
    items = workload(seed=3, n=20)
    reqs = submit(core, clock, items)
    doomed = {r.rid for r in rng.sample(reqs, 8)}
    steps = 0
    while core.has_work():
        steps += 1
        plan = core.launch()
        assert plan is not None
        for rid in list(doomed):
            if rng.random() < 0.2:
                core.abort(rid)  # while the step "runs": queued, mid-chunk or decoding
                doomed.discard(rid)
        core.land(plan, runner.execute(plan))
        core.kv.check_invariant()
        assert steps < 5000
    for rid in doomed:
        assert not core.abort(rid)  # finished before its turn came
    stats = core.kv.stats()
    assert (
        stats["pages_used"] == 0
        and stats["pages_free"] + stats["pages_cached"] + stats["pages_tail"]
        == stats["pages_total"]
    )
    for req, (prompt, n) in zip(reqs, items, strict=True):
        if req.finish_reason == "abort":
            assert req.output_ids == reference_output(prompt, n)[: len(req.output_ids)]
        else:
            assert req.output_ids == reference_output(prompt, n), req.rid


def test_failed_step_fails_its_requests_and_caches_nothing() -> None:
    core, runner, clock = make_scheduler()
    submit(core, clock, [(list(range(1, 40)), 4), (list(range(50, 90)), 4)])
    plan = core.launch()
    assert plan is not None
    failed = core.land(plan, RuntimeError("forward failed")).failed
    assert {r.rid for r in failed} == {"r0", "r1"}
    assert all(r.finish_reason == "abort" for r in failed)
    core.kv.check_invariant()
    stats = core.kv.stats()
    assert stats["pages_cached"] == 0 and stats["pages_free"] == stats["pages_total"]


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    core, runner, clock = make_scheduler()
    prompt = [3, 1, 4, 1, 5]
    expected = reference_output(prompt, 10)
    req = Request("a", prompt, SamplingParams(max_new_tokens=10, stop_token_ids=[expected[2]]), 0.0)
    core.add(req)
    drive(core, runner, clock)
    assert req.output_ids == expected[:3]
    assert req.finish_reason == "stop" and req.matched_stop == expected[2]


def test_max_model_len_ends_with_length() -> None:
    core, runner, clock = make_scheduler(max_model_len=12)
    req = Request("a", list(range(1, 9)), SamplingParams(max_new_tokens=100), 0.0)
    core.add(req)
    drive(core, runner, clock)
    assert req.num_tokens == 12 and req.finish_reason == "length"


@pytest.mark.parametrize("chunk", [8, 0], ids=["mid-chunk", "whole-prompt"])
def test_request_id_reused_while_its_step_runs(chunk: int) -> None:
    """A request aborted while its step runs frees its id at once; a new request that takes
    the id must not receive the old step's token (nor crash the commit of a chunk)."""
    core, runner, clock = make_scheduler(chunked_prefill_size=chunk, max_prefill_tokens=64)
    submit(core, clock, [(list(range(1, 30)), 4)], tag="x")
    plan = core.launch()
    assert plan is not None
    assert core.abort("x0")  # while the step "runs"
    again = Request("x0", [5, 6, 7], SamplingParams(max_new_tokens=3), clock())
    core.add(again)
    assert core.land(plan, runner.execute(plan)).tokens == []
    assert again.output_ids == [] and again.status is RequestStatus.WAITING
    core.kv.check_invariant()
    drive(core, runner, clock)
    assert again.output_ids == reference_output([5, 6, 7], 3)


def test_failed_step_does_not_fail_a_request_that_reused_an_id() -> None:
    core, runner, clock = make_scheduler()
    submit(core, clock, [(list(range(1, 30)), 4)], tag="x")
    plan = core.launch()
    assert plan is not None
    core.abort("x0")
    again = Request("x0", [5, 6, 7], SamplingParams(max_new_tokens=3), clock())
    core.add(again)
    assert core.land(plan, RuntimeError("forward failed")).failed == []
    drive(core, runner, clock)
    assert again.output_ids == reference_output([5, 6, 7], 3)


def test_retract_takes_the_request_with_least_output_and_resets_the_ratio(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 6 pages of 4 tokens: each request alone fits (4 + 20 tokens), both together do not
    core, runner, clock = make_scheduler(
        num_pages=6,
        page_size=4,
        max_model_len=24,
        init_new_token_ratio=0.5,
        min_new_token_ratio=0.01,
        new_token_ratio_decay=0.1,
    )
    (first,) = submit(core, clock, [([1, 2, 3, 4], 20)], tag="a")
    ratios = []
    for _ in range(5):  # its prefill, then decode-only steps: the ratio decays each step
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
        ratios.append(core.scheduler.new_token_ratio)
    assert ratios[0] == 0.5 and ratios[1:] == pytest.approx([0.4, 0.3, 0.2, 0.1])
    (second,) = submit(core, clock, [([9, 8, 7, 6], 20)], tag="b")
    caplog.set_level("WARNING", logger="asyncengine.scheduler.scheduler")
    while core.scheduler.retraction.total_retractions == 0:
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
        core.kv.check_invariant()
    # the later request has fewer outputs: it loses least work
    assert (second.retractions, first.retractions) == (1, 0)
    assert core.scheduler.new_token_ratio >= 0.4  # reset to 0.5, then at most one step's decay
    assert any("retracted 1 request(s) (b0)" in r.getMessage() for r in caplog.records)
    drive(core, runner, clock)
    assert first.output_ids == reference_output([1, 2, 3, 4], 20)
    assert second.output_ids == reference_output([9, 8, 7, 6], 20)  # nothing emitted twice


def test_token_budget_bounds_prefill_plus_decode_tokens_per_step() -> None:
    core, runner, clock = make_scheduler(
        policy="token-budget",
        policy_options={"prefill_tokens": 8, "total_tokens": 10},
    )
    submit(core, clock, [([1 + i, 2, 3], 30) for i in range(6)], tag="short")
    for _ in range(2):
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
    submit(core, clock, [(list(range(100, 140)), 2), (list(range(200, 240)), 2)], tag="long")
    plans = drive(core, runner, clock)
    mixed = [p for p in plans if p.extends and p.decodes]
    assert mixed, "no step carried prefill and decodes together"
    for p in plans:
        if p.extends:
            assert sum(s.num_tokens for s in p.extends) + len(p.decodes) <= 10
            assert sum(s.num_tokens for s in p.extends) <= 8
    # with six decodes the joint budget, not the prefill one, is what binds
    assert any(len(p.decodes) == 6 and sum(s.num_tokens for s in p.extends) == 4 for p in mixed)
