"""TimedExecutor: another executor whose measured time advances a virtual clock.

With ``timer=time.thread_time`` (and one torch thread, so the forward runs on the calling
thread) the clock counts this thread's CPU time, which other processes on the machine inflate
far less than wall time. ``repeats`` > 1 runs each plan that many times and counts the fastest:
a greedy forward is idempotent (the same KV slots get the same values, the same tokens come out),
and the minimum drops the slow-downs that other processes cause.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, StepOutput
from asyncengine.core.executor_api import Executor, KVLayout, ModelSpec
from asyncengine.sim.clock import VirtualClock


class TimedExecutor:
    def __init__(
        self,
        inner: Executor,
        clock: VirtualClock,
        timer: Callable[[], float] = time.thread_time,
        repeats: int = 1,
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.inner = inner
        self.clock = clock
        self.timer = timer
        self.repeats = repeats
        self.spent = 0.0  # timer seconds the last execute took, every repeat included

    @property
    def spec(self) -> ModelSpec:
        return self.inner.spec

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        return self.inner.kv_budget_bytes(config)

    def bind(self, layout: KVLayout) -> None:
        self.inner.bind(layout)

    def execute(self, plan: BatchPlan) -> StepOutput:
        timer = self.timer
        start = timer()
        best = math.inf
        for _ in range(self.repeats):
            forward_start = timer()
            output = self.inner.execute(plan)
            best = min(best, timer() - forward_start)
        self.spent = timer() - start
        output.forward_seconds = best
        self.clock.advance(best)  # the tokens are out now: commit stamps them at this time
        return output
