"""Overlap scheduling: the next plan made while the one in flight has not landed (its decodes'
inputs deferred to the executor) gives every request the tokens, endings and KV that planning
after each landing gives; the plans it may not make ahead (structured output, penalties,
seeds, speculation, a KV shortage) it does not."""

from __future__ import annotations

import random

import pytest

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.engine_core import EngineCore
from tests.fake_executor import FakeExecutor, StopStringAt, fake_core, reference_output
from tests.scheduler.test_scheduler import Clock


def drive_overlapped(core: EngineCore, executor: FakeExecutor, clock: Clock) -> list[BatchPlan]:
    """The step loop's order with overlap: plan N+1 (when it may) before N lands; the
    executor runs the plans in the order they were made. Returns the plans made ahead."""
    ahead_plans: list[BatchPlan] = []
    pending = core.launch()
    idle = 0
    while pending is not None or core.has_work():
        if pending is None:
            pending = core.launch()
            idle += 1
            assert idle < 1000, "the core has work but plans nothing"
            continue
        ahead = None
        if core.can_launch_ahead():
            ahead = core.launch()
            if ahead is not None:
                ahead_plans.append(ahead)
        output = core.execute(pending)
        clock.t += output.forward_seconds
        core.land(pending, output)
        core.check_invariant()
        pending = ahead if ahead is not None else (core.launch() if core.has_work() else None)
    return ahead_plans


def drive_lock_step(core: EngineCore, clock: Clock) -> None:
    while core.has_work():
        events = core.step()
        if events is not None:
            clock.t += events.forward_seconds
        core.check_invariant()


def workload(seed: int, clock: Clock) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 999) for _ in range(24)]
    reqs = []
    for i in range(24):
        head = shared[: rng.randrange(4, 24)] if i % 3 == 0 else []
        prompt = head + [rng.randrange(1, 999) for _ in range(rng.randrange(1, 40))]
        n = rng.randrange(1, 30)
        params: dict[str, object] = {}
        if i % 4 == 1:  # stops at a token it samples (or runs to its length)
            params["stop_token_ids"] = [reference_output(prompt, n)[rng.randrange(n)]]
        reqs.append(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_new_tokens=n, temperature=0, **params),
                clock(),  # type: ignore[arg-type]
            )
        )
        if i % 4 == 3 and n > 2:  # a stop string completed at its k-th token
            reqs[-1].text = StopStringAt(rng.randrange(1, n))
    return reqs


def outcome(reqs: list[Request]) -> dict[str, tuple[list[int], str | None]]:
    return {r.rid: (list(r.output_ids), r.finish_reason) for r in reqs}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"enable_mixed_batch": False},
        {"chunked_prefill_size": 8, "max_prefill_tokens": 16},
        {"enable_prefix_cache": False},
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_planned_ahead_gives_the_lock_step_tokens_and_endings(
    overrides: dict[str, object], seed: int
) -> None:
    results = []
    made_ahead = 0
    for overlapped in (False, True):
        clock = Clock()
        core, executor = fake_core(256, 4, 1024, clock, **overrides)
        executor.defers_inputs = overlapped
        reqs = workload(seed, clock)
        for req in reqs:
            core.add(req)
        if overlapped:
            plans = drive_overlapped(core, executor, clock)
            made_ahead = sum(bool(p.deferred) for p in plans)
        else:
            drive_lock_step(core, clock)
        assert core.kv.stats()["pages_used"] == 0
        results.append(outcome(reqs))
    assert results[1] == results[0]
    assert made_ahead > 10, "the overlapped run was meant to plan most decode steps ahead"
    for rid, (_, reason) in results[0].items():
        assert reason in ("length", "stop"), rid


def test_nothing_past_the_end_and_the_length_known_ahead() -> None:
    """A request that the token in flight ends by length is left out of the plan made ahead;
    one it ends by a stop token or string decodes once more, and that token is dropped."""
    clock = Clock()
    core, executor = fake_core(64, 4, 1024, clock)
    executor.defers_inputs = True
    prompt = [3, 4, 5]
    expected = reference_output(prompt, 6)
    by_length = Request("len", prompt, SamplingParams(max_new_tokens=3, temperature=0), clock())
    by_token = Request(
        "tok",
        prompt,
        SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=[expected[2]]),
        clock(),
    )
    by_text = Request("txt", prompt, SamplingParams(max_new_tokens=6, temperature=0), clock())
    by_text.text = StopStringAt(3)  # type: ignore[assignment]
    for req in (by_length, by_token, by_text):
        core.add(req)
    plans = drive_overlapped(core, executor, clock)
    for req in (by_length, by_token, by_text):
        assert req.output_ids == expected[:3], req.rid
    assert [r.finish_reason for r in (by_length, by_token, by_text)] == ["length", "stop", "stop"]
    decoded = {
        rid: sum(seg.rid == rid for p in plans for seg in p.decodes) for rid in ("len", "tok")
    }
    assert decoded["len"] < decoded["tok"]  # its last decode was known not to be needed


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1.2},
        {"presence_penalty": 0.5},
        {"seed": 7, "temperature": 1.0},
        {"min_new_tokens": 8},
    ],
)
def test_sampling_that_reads_its_output_is_not_planned_ahead(params: dict[str, object]) -> None:
    clock = Clock()
    core, executor = fake_core(64, 4, 1024, clock)
    executor.defers_inputs = True
    plain = Request("plain", [1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0), clock())
    values: dict[str, object] = {"max_new_tokens": 10, "temperature": 0, **params}
    reads = Request("reads", [4, 5, 6], SamplingParams(**values), clock())  # type: ignore[arg-type]
    core.add(plain)
    core.add(reads)
    plans = drive_overlapped(core, executor, clock)
    assert reads.output_ids == reference_output([4, 5, 6], 10)
    if "min_new_tokens" in params:  # from its 8th token on, nothing is read
        assert any(p.deferred for p in plans)
    else:
        assert not any(p.deferred for p in plans)


def test_speculation_and_a_kv_shortage_plan_after_the_landing() -> None:
    clock = Clock()
    core, executor = fake_core(
        64, 4, 1024, clock, speculative={"method": "ngram", "num_speculative_tokens": 2}
    )
    executor.defers_inputs = True
    core.add(
        Request("a", [1, 2, 1, 2, 1, 2], SamplingParams(max_new_tokens=12, temperature=0), clock())
    )
    assert not drive_overlapped(core, executor, clock)

    clock = Clock()
    core, executor = fake_core(12, 4, 1024, clock)  # 48 slots for 4 requests of 20 tokens
    executor.defers_inputs = True
    reqs = [
        Request(f"s{i}", [i + 1] * 4, SamplingParams(max_new_tokens=16, temperature=0), clock())
        for i in range(4)
    ]
    for req in reqs:
        core.add(req)
    drive_overlapped(core, executor, clock)
    assert core.scheduler.retraction.total_retractions > 0
    for req in reqs:
        assert req.output_ids == reference_output(req.prompt_ids, 16), req.rid
