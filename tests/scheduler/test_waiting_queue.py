"""The scheduler's waiting queue (asyncengine/scheduler/waiting_queue.py) reads as the list it replaced.

Random appends, pushes to the front and removals from anywhere leave it equal to a list given
the same operations, read every way a policy may read it (iteration, ``len``, ``in``, indexes,
slices, ``index``); the cheap window (``oldest``) and the shared one (``head``) are the list's
head.
"""

from __future__ import annotations

import random

import pytest

from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.scheduler.waiting_queue import WaitingQueue
from policies.base import Policy


def _request(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=4), float(i))


def _assert_reads_as(queue: WaitingQueue, model: list[Request]) -> None:
    assert list(queue) == model
    assert len(queue) == len(model) and bool(queue) == bool(model)
    assert list(reversed(queue)) == model[::-1]
    for index in range(-len(model), len(model)):
        assert queue[index] is model[index]
    for start, stop, step in [
        (None, 3, None),
        (1, 4, None),
        (2, None, None),
        (-3, None, None),
        (None, None, 2),
        (5, 2, None),
        (None, -1, None),
    ]:
        assert queue[start:stop:step] == model[start:stop:step]
    for req in model:
        assert req in queue and queue.index(req) == model.index(req)
    assert queue.oldest(3) == model[:3] and queue.oldest(0) == []
    assert queue.head(3) == model[:3] and queue.head(3) is queue.head(3) and queue.head(0) == []
    assert Policy().candidates(queue, 4) == model[:4]


def test_queue_matches_a_list_under_random_changes() -> None:
    rng = random.Random(7)
    queue, model = WaitingQueue(), []
    made = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.5 or not model:
            req = _request(made)
            made += 1
            if rng.random() < 0.2:
                queue.push_front(req)
                model.insert(0, req)
            else:
                queue.append(req)
                model.append(req)
        else:
            req = model[rng.randrange(len(model))]
            queue.remove(req)
            model.remove(req)
        # the shared head window follows every change (asked each step, as a simulation does)
        assert queue.head(5) == model[:5]
        if made % 25 == 0:
            _assert_reads_as(queue, model)
    _assert_reads_as(queue, model)


def test_queue_refuses_what_a_queue_of_distinct_requests_cannot_hold() -> None:
    first, second = _request(0), _request(1)
    queue = WaitingQueue([first])
    with pytest.raises(ValueError, match="already waiting"):
        queue.append(first)
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(second)
    with pytest.raises(IndexError):
        queue[1]
    with pytest.raises(ValueError):
        queue.index(second)
    assert second not in queue and "r0" not in queue
    assert repr(queue) == "WaitingQueue(['r0'])"
