"""run_between_steps: the pieces of one-time work run on the worker thread, back to back while
the engine is idle, and with pauses that keep them to BUSY_SHARE of a busy engine's time."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncengine.api.one_time_work import BUSY_SHARE, run_between_steps

PIECE_SECONDS = 0.01


class Pieces:
    """``count`` pieces of work, each sleeping PIECE_SECONDS; records each piece's thread."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.threads: list[str] = []

    def __call__(self) -> bool:
        self.threads.append(threading.current_thread().name)
        time.sleep(PIECE_SECONDS)
        self.left -= 1
        return self.left > 0


async def test_idle_engine_runs_pieces_back_to_back_on_the_worker() -> None:
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    work = Pieces(5)
    with ThreadPoolExecutor(1, thread_name_prefix="forward") as worker:
        await run_between_steps(worker, work, busy=lambda: False, pause=pause)
    assert work.left == 0
    assert pauses == []
    assert all(name.startswith("forward") for name in work.threads)


async def test_busy_engine_pauses_in_proportion_to_each_piece() -> None:
    pauses: list[float] = []
    busy_flags = iter([True, False, True])  # busy after the first and third piece only

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    work = Pieces(4)
    with ThreadPoolExecutor(1) as worker:
        await run_between_steps(worker, work, busy=lambda: next(busy_flags), pause=pause)
    assert work.left == 0
    assert len(pauses) == 2  # no pause after the last piece, none while idle
    least = PIECE_SECONDS * (1.0 / BUSY_SHARE - 1.0)
    assert all(least <= seconds < 20 * least for seconds in pauses)


async def test_failing_piece_ends_the_work_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    def work() -> bool:
        nonlocal calls
        calls += 1
        raise RuntimeError("no room for the panels")

    with ThreadPoolExecutor(1) as worker, caplog.at_level(logging.WARNING):
        await run_between_steps(worker, work, busy=lambda: True)
    assert calls == 1
    assert "one-time work after start-up failed" in caplog.text
