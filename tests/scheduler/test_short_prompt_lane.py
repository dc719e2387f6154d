"""Short prompts beside a long prompt mid-chunk (``short_prompt_tokens``): they join its steps,
the long prompt keeps at least half of each chunk, and at most one prompt is ever mid-chunk."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request, RequestStatus
from asyncengine.core.engine_core import EngineCore
from tests.fake_executor import reference_output
from tests.scheduler.test_scheduler import drive, make_scheduler, step, submit

LONG = list(range(1, 65))  # 64 tokens: four chunks of 16


def tokens(plan: BatchPlan, rid: str) -> int:
    return sum(len(s.input_ids) for s in plan.extends if s.rid == rid)


def test_a_short_prompt_joins_the_next_step_of_a_long_prompt_mid_chunk() -> None:
    core, runner, clock = make_scheduler(chunked_prefill_size=16, max_prefill_tokens=16)
    (long,) = submit(core, clock, [(LONG, 3)], tag="long")
    assert tokens(step(core, runner, clock), "long0") == 16
    assert core.scheduler.chunked is long
    (short,) = submit(core, clock, [([900, 901, 902, 903, 904], 3)], tag="short")
    plan = step(core, runner, clock)
    # the long prompt's chunk gives up the short one's pages (page 4: 16 - 5 -> 8 whole pages'
    # worth, 8 tokens), the short prompt ends in this step and samples its first token
    assert tokens(plan, "long0") == 8 and tokens(plan, "short0") == 5
    assert [s.rid for s in plan.extends] == ["long0", "short0"]
    assert len(short.output_ids) == 1 and short.status is RequestStatus.RUNNING
    assert core.scheduler.chunked is long
    drive(core, runner, clock)
    assert long.output_ids == reference_output(LONG, 3)
    assert short.output_ids == reference_output([900, 901, 902, 903, 904], 3)


def test_with_no_lane_a_short_prompt_waits_for_the_whole_long_prefill() -> None:
    core, runner, clock = make_scheduler(
        chunked_prefill_size=16, max_prefill_tokens=16, short_prompt_tokens=0
    )
    (long,) = submit(core, clock, [(LONG, 3)], tag="long")
    step(core, runner, clock)
    (short,) = submit(core, clock, [([900, 901, 902, 903, 904], 3)], tag="short")
    for _ in range(3):
        plan = step(core, runner, clock)
        assert tokens(plan, "long0") == 16 and tokens(plan, "short0") == 0
    assert core.scheduler.blocked(short) == {"token_budget": 3}  # the chunk took every token
    assert len(long.output_ids) == 1 and short.status is RequestStatus.WAITING
    drive(core, runner, clock)
    assert short.output_ids == reference_output([900, 901, 902, 903, 904], 3)


def test_a_prompt_longer_than_the_lane_waits_behind_the_one_mid_chunk() -> None:
    core, runner, clock = make_scheduler(
        chunked_prefill_size=16, max_prefill_tokens=16, short_prompt_tokens=6
    )
    (long,) = submit(core, clock, [(LONG, 2)], tag="long")
    step(core, runner, clock)
    medium, short = submit(core, clock, [(list(range(200, 212)), 2), ([300, 301], 2)], tag="w")
    plan = step(core, runner, clock)
    # the medium prompt (12 tokens) would not end in this step: it waits, the short one joins
    assert tokens(plan, "w0") == 0 and tokens(plan, "w1") == 2
    assert medium.status is RequestStatus.WAITING
    assert core.scheduler.blocked(medium) == {"chunk_in_flight": 1}
    drive(core, runner, clock)
    assert medium.output_ids == reference_output(list(range(200, 212)), 2)
    assert short.output_ids == reference_output([300, 301], 2)


def mid_chunk(core: EngineCore) -> list[Request]:
    return [r for r in core.scheduler.prefilling if r.kv.kv_len < r.num_tokens]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chunk=st.sampled_from([8, 16, 32]),
    lane=st.sampled_from([0, 4, 8, 256]),
    arrivals=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 90), st.integers(1, 5)),
        min_size=1,
        max_size=14,
    ),
)
def test_every_step_keeps_one_prompt_mid_chunk_and_the_chunk_bound(
    chunk: int, lane: int, arrivals: list[tuple[int, int, int]]
) -> None:
    """Prompts of any length arrive between steps; each step computes at most the chunk, at
    most one prompt is left mid-chunk, a prompt mid-chunk gets at least half of the step's
    chunk (page-aligned) while it has that much left, and every output is exact."""
    core, runner, clock = make_scheduler(
        chunked_prefill_size=chunk, max_prefill_tokens=chunk, short_prompt_tokens=lane
    )
    page = core.kv.page_size
    pending = sorted(arrivals, key=lambda a: a[0])
    reqs: list[tuple[Request, list[int], int]] = []
    for steps in range(2000):
        while pending and pending[0][0] <= steps:
            _, length, out = pending.pop(0)
            prompt = [1000 + len(reqs) * 100 + i for i in range(length)]
            (req,) = submit(core, clock, [(prompt, out)], tag=f"q{len(reqs)}-")
            reqs.append((req, prompt, out))
        if not core.has_work():
            if not pending:
                break
            continue
        before = core.scheduler.chunked
        left = None if before is None else before.num_tokens - before.kv.kv_len
        plan = step(core, runner, clock)
        assert sum(len(s.input_ids) for s in plan.extends) <= chunk
        assert len(mid_chunk(core)) <= 1
        if before is not None and left is not None:
            half = chunk // 2 // page * page
            assert tokens(plan, before.rid) >= min(left, half)
    assert not pending and not core.has_work()
    for req, prompt, out in reqs:
        assert req.output_ids == reference_output(prompt, out)
