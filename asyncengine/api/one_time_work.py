"""One-time work an executor leaves to be done after start-up (the real model's int8 panels:
executor_api.defer_one_time_work), run on the forward's worker thread a piece at a time, so
that it takes no core from a step and delays the readiness and a step by one piece at most."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("asyncengine.api.engine")


async def run_between_steps(worker: ThreadPoolExecutor, work: Callable[[], bool]) -> None:
    """``work()`` on ``worker`` until it returns False, one call queued at a time: a step the
    loop submits meanwhile runs after the call in progress, before the next one. A failure is
    logged and ends the work (what it left undone is done by the steps that need it)."""
    loop = asyncio.get_running_loop()
    try:
        while await loop.run_in_executor(worker, work):
            pass
    except Exception:
        log.warning("one-time work after start-up failed; the steps do it", exc_info=True)
