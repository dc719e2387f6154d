"""One-time work an executor leaves to be done after start-up (the real model's huge pages and
int8 panels: executor_api.defer_one_time_work), run on the forward's worker thread a piece at a
time, so that it takes no core from a step and delays the readiness and a step by one piece at
most.

An idle engine runs the pieces back to back; a busy one gives them ``BUSY_SHARE`` of its time at
most, so the first requests after start-up decode at nearly full speed (a piece between every
step of a 1B Q4_K_M stream makes its token gap 24 ms, against 17 ms once the panels are built)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("asyncengine.api.engine")

# The most of a busy engine's time the pieces take: after a piece of d seconds, the next one
# waits d * (1 / BUSY_SHARE - 1) while requests run (what is left undone when a many-row call
# needs it, that call's projection builds itself: linear.I8_DEFERRED_ROWS)
BUSY_SHARE = 0.1


def _timed(work: Callable[[], bool]) -> tuple[bool, float]:
    start = time.perf_counter()
    more = work()
    return more, time.perf_counter() - start


async def run_between_steps(
    worker: ThreadPoolExecutor,
    work: Callable[[], bool],
    busy: Callable[[], bool] = lambda: False,
    pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """``work()`` on ``worker`` until it returns False, one call queued at a time: a step the
    loop submits meanwhile runs after the call in progress, before the next one. While
    ``busy()`` (requests to run), each call is followed by a ``pause`` that keeps the calls to
    ``BUSY_SHARE`` of the time. A failure is logged and ends the work (what it left undone is
    done by the steps that need it)."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            more, seconds = await loop.run_in_executor(worker, _timed, work)
            if not more:
                return
            if busy():
                await pause(seconds * (1.0 / BUSY_SHARE - 1.0))
    except Exception:
        log.warning("one-time work after start-up failed; the steps do it", exc_info=True)
