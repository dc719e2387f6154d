"""Every way a request ends is decided on the core side and reported in the step's events."""

from __future__ import annotations

from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.engine_core import EngineCore
from asyncengine.scheduler.step_events import StepEvents
from tests.fake_executor import FakeExecutor, StopStringAt, fake_core, reference_output
from tests.scheduler.test_scheduler import Clock


def make(**overrides: object) -> tuple[EngineCore, FakeExecutor, Clock]:
    clock = Clock()
    core, executor = fake_core(64, 4, 1024, clock, **overrides)
    core.step_hooks.append(lambda plan: core.check_invariant())
    return core, executor, clock


def request(rid: str, prompt: list[int], n: int, clock: Clock, **params: object) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0, **params), clock())  # type: ignore[arg-type]


def run(core: EngineCore, clock: Clock) -> list[StepEvents]:
    reports = []
    while core.has_work():
        events = core.step()
        assert events is not None
        clock.t += events.forward_seconds
        reports.append(events)
    return reports


def ended_by(reports: list[StepEvents]) -> dict[str, str | None]:
    return {req.rid: req.finish_reason for events in reports for req in events.ended}


def test_each_ending_is_reported_once_with_its_reason() -> None:
    core, executor, clock = make()
    prompt = [5, 6, 7]
    expected = reference_output(prompt, 8)
    reqs = [
        request("length", prompt, 4, clock),
        request("stop-id", prompt, 8, clock, stop_token_ids=[expected[2]]),
        request("stop-string", prompt, 8, clock),
        request("late", [9, 9, 9], 8, clock, timeout=0.5),
    ]
    reqs[2].text = StopStringAt(3)
    for req in reqs:
        core.add(req)
    first = core.step()
    assert first is not None
    clock.t = 1.0  # past "late"'s deadline
    reports = [first, *run(core, clock)]
    ends = [req.rid for events in reports for req in events.ended]
    assert sorted(ends) == sorted(r.rid for r in reqs)  # once each
    assert ended_by(reports) == {
        "length": "length",
        "stop-id": "stop",
        "stop-string": "stop",
        "late": "timeout",
    }
    assert reqs[1].matched_stop == expected[2] and reqs[1].output_ids == expected[:3]
    # the stop string ends its request in the step of the token that completed it
    assert reqs[2].matched_stop == "END" and reqs[2].output_ids == expected[:3]
    last_token = [e for events in reports for e in events.tokens if e.req is reqs[2]][-1]
    assert last_token.finished
    assert core.counters["finished_stop"] == 2 and core.counters["finished_timeout"] == 1


def test_an_abort_and_a_failed_forward_are_reported() -> None:
    core, executor, clock = make()
    core.add(request("a", [1, 2, 3], 20, clock))
    core.add(request("b", [4, 5, 6], 20, clock))
    assert core.step() is not None
    assert core.abort("a") and not core.abort("a")
    aborted = core.events()
    assert [r.rid for r in aborted.ended] == ["a"] and aborted.plan is None
    executor.fail_on_step = executor.steps + 1
    failed = core.step()
    assert failed is not None and failed.error is not None
    assert [r.rid for r in failed.failed] == ["b"] and [r.rid for r in failed.ended] == ["b"]
    assert not core.has_work() and core.counters["failed"] == 1
    assert core.kv.stats()["pages_used"] == 0


def test_choices_fork_their_leader_once_it_prefilled() -> None:
    core, executor, clock = make()
    prompt = list(range(1, 14))
    leader, *followers = [request(f"r-{i}", prompt, 3, clock) for i in range(3)]
    core.add(leader, followers)
    first = core.step()
    assert first is not None and [s.rid for s in first.plan.segments] == ["r-0"]  # type: ignore[union-attr]
    assert first.released == followers
    reports = run(core, clock)
    assert set(ended_by([first, *reports])) == {"r-0", "r-1", "r-2"}
    for req in (leader, *followers):
        assert req.output_ids == reference_output(prompt, 3)
    assert all(f.cached_tokens == 12 for f in followers)  # the prompt's whole pages, forked


def test_choices_end_with_a_leader_that_ends_before_prefilling() -> None:
    core, executor, clock = make(max_running_requests=1)
    core.add(request("busy", [1, 2, 3], 30, clock))
    assert core.step() is not None
    leader, *followers = [request(f"r-{i}", [7, 8, 9], 3, clock, timeout=0.5) for i in range(3)]
    core.add(leader, followers)
    clock.t = 1.0
    reports = run(core, clock)
    assert ended_by(reports) == {
        "r-0": "timeout",
        "r-1": "timeout",
        "r-2": "timeout",
        "busy": "length",
    }
    assert all(f.finished for f in followers)
    # and an abort of the leader ends the choices waiting on it
    core.add(request("busy2", [1, 2, 3], 30, clock))
    assert core.step() is not None
    leader, *followers = [request(f"s-{i}", [7, 8, 9], 3, clock) for i in range(2)]
    core.add(leader, followers)
    assert core.abort("s-0")
    assert [r.rid for r in core.events().ended] == ["s-0", "s-1"]
