"""The overlapped loop over an executor that launches in two halves (as the GPU executor does):
the worker thread launches, the waiter thread waits for the output. Token-exact against the
lock-step loop, plans made ahead, and a failure in either half fails its batch alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import RequestFailedError
from asyncengine.common.plan import BatchPlan, StepOutput
from asyncengine.common.sampling_params import SamplingParams
from tests.api.test_engine_loop import (
    CharTokenizer,
    CheckedEngine,
    assert_idle_and_clean,
    wait_idle,
)
from tests.fake_executor import FakeExecutor, reference_output


class SplitFakeExecutor(FakeExecutor):
    """FakeExecutor with ``launch``: the step runs in the first half; the second returns it,
    after a short wait, as a device's would. ``fail_launch`` / ``fail_collect``: the launch
    (counted from 1) whose first or second half raises."""

    def __init__(self) -> None:
        super().__init__()
        self.defers_inputs = True
        self.launches = 0
        self.fail_launch: int | None = None
        self.fail_collect: int | None = None
        self.threads: set[str] = set()

    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        self.launches += 1
        number = self.launches
        self.threads.add(threading.current_thread().name)
        if number == self.fail_launch:
            raise RuntimeError("launch failed")
        output = self.execute(plan)

        def collect() -> StepOutput:
            self.threads.add(threading.current_thread().name)
            if number == self.fail_collect:
                raise RuntimeError("collect failed")
            threading.Event().wait(0.0005)
            return output

        return collect


def split_engine(overlap: bool) -> CheckedEngine:
    config = EngineConfig.from_dict(
        {"page_size": 4, "kv_cache_tokens": 512, "log_interval": 0,
         "enable_overlap_schedule": overlap}
    )  # fmt: skip
    return CheckedEngine(config, executor=SplitFakeExecutor(), tokenizer=CharTokenizer())


PROMPTS = [[1 + i, 2, 3, 4 + i] * (i + 1) for i in range(6)]


@pytest.mark.parametrize("overlap", [True, False])
async def test_outputs_are_the_lock_step_ones(overlap: bool) -> None:
    engine = split_engine(overlap)
    ahead: list[int] = []
    async with engine:
        engine.step_hooks.append(lambda plan: ahead.append(len(plan.deferred)))
        params = SamplingParams(max_new_tokens=9, ignore_eos=True)
        outs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out.token_ids == reference_output(prompt, 9)
        await wait_idle(engine)
        assert_idle_and_clean(engine)
        executor = engine.executor  # the engine lets go of it at the end of `async with`
    assert isinstance(executor, SplitFakeExecutor)
    if overlap:
        assert sum(1 for n in ahead if n) > 3, "steps were meant to be planned ahead"
        assert any(name.startswith("asyncengine-wait") for name in executor.threads)
    else:
        assert not any(ahead)


@pytest.mark.parametrize("half", ["launch", "collect"])
async def test_a_failing_half_fails_its_batch_and_the_engine_keeps_serving(half: str) -> None:
    engine = split_engine(True)
    async with engine:
        executor = engine.executor
        assert isinstance(executor, SplitFakeExecutor)
        setattr(executor, f"fail_{half}", executor.launches + 1)
        with pytest.raises(RequestFailedError, match=f"{half} failed"):
            await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
        out = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
        assert out.token_ids == reference_output([1, 2, 3], 4)
        await wait_idle(engine)
        assert_idle_and_clean(engine)
