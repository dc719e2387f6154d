"""The scheduling controls end to end through the AsyncEngine (its event loop, forward thread
and streams) over the model-free executor: priority overtakes under load, a timeout frees
pages, fairness bounds the light tenant's wait, a policy swap mid-run leaks nothing, a shadow
policy changes nothing. The KV invariant is checked after every step."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.outputs import GenerateOutput
from asyncengine.common.plan import BatchPlan, StepOutput
from asyncengine.common.sampling_params import SamplingParams
from tests.api.test_engine_loop import (
    CharTokenizer,
    CheckedEngine,
    assert_idle_and_clean,
    wait_idle,
)
from tests.fake_executor import FakeExecutor, reference_output


class SlowExecutor(FakeExecutor):
    """A FakeExecutor whose every forward takes ``delay`` seconds (on the forward thread), so
    requests queue up behind each other as under load."""

    def __init__(self, delay: float = 0.002, max_model_len: int = 512) -> None:
        super().__init__(max_model_len)
        self.delay = delay

    def execute(self, plan: BatchPlan) -> StepOutput:
        time.sleep(self.delay)
        return super().execute(plan)


def engine(delay: float = 0.002, num_pages: int = 256, **overrides: object) -> AsyncEngine:
    values: dict[str, object] = {
        "page_size": 4,
        "kv_cache_tokens": num_pages * 4,
        "log_interval": 0,
        **overrides,
    }
    return CheckedEngine(
        EngineConfig.from_dict(values), executor=SlowExecutor(delay), tokenizer=CharTokenizer()
    )


def params(n: int, **controls: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, **controls)  # type: ignore[arg-type]


async def until(predicate: object, steps: int = 2000) -> None:
    for _ in range(steps):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def prompt(k: int, length: int = 12) -> list[int]:
    return [(k * 31 + j * 7) % 997 + 1 for j in range(length)]


@pytest.mark.parametrize(
    ("policy", "options", "vip_place"),
    [
        ("fcfs", {}, 6),  # behind everyone who came first
        ("priority", {}, 1),  # next, once the request running now is done
        ("priority", {"preempt": True}, 0),  # at once: the running one is retracted for it
    ],
)
async def test_priority_overtakes_under_load(
    policy: str, options: dict[str, object], vip_place: int
) -> None:
    async with engine(policy=policy, policy_options=options, max_running_requests=1) as eng:
        finished: list[str] = []

        async def run(rid: str, ids: list[int], p: SamplingParams) -> GenerateOutput:
            out = await eng.generate(ids, p, request_id=rid)
            finished.append(rid)
            return out

        lows = [
            asyncio.create_task(run(f"low{k}", prompt(k), params(30, priority=5))) for k in range(6)
        ]
        await until(lambda: eng.stats()["running"] == 1 and eng.stats()["generated_tokens"] > 2)
        vip = await run("vip", prompt(99), params(30, priority=-1))
        outs = await asyncio.gather(*lows)
        assert finished.index("vip") == vip_place, finished
        assert vip.token_ids == reference_output(prompt(99), 30)
        for k, out in enumerate(outs):  # a retracted request never emits a token twice
            assert out.token_ids == reference_output(prompt(k), 30)
        assert (eng.stats()["preemptions"] > 0) == bool(options)
        await wait_idle(eng)
        assert_idle_and_clean(eng)


async def test_timeouts_free_pages_and_leave_the_others_alone() -> None:
    async with engine(max_running_requests=1) as eng:
        blocker = asyncio.create_task(eng.generate(prompt(1), params(80), request_id="blocker"))
        await until(lambda: eng.stats()["running"] == 1)
        # never started: waits behind the blocker past its deadline
        waited = await eng.generate(prompt(2), params(10, timeout=0.01), request_id="waited")
        assert waited.finish_reason == "timeout" and waited.token_ids == []
        assert waited.metrics.queue_time is None
        assert waited.metrics.blocked.get("running_cap", 0) >= 1
        out = await blocker
        assert out.token_ids == reference_output(prompt(1), 80)
        # started, then ran out of time mid-generation: what it made is a prefix of its output.
        # 480 steps of 2 ms take >= 0.96 s, so 0.4 s always cuts it, and leaves a loaded machine
        # time for its first token.
        cut = await eng.generate(prompt(3), params(480, timeout=0.4), request_id="cut")
        assert cut.finish_reason == "timeout" and 0 < len(cut.token_ids) < 480
        assert cut.token_ids == reference_output(prompt(3), len(cut.token_ids))
        stats = eng.stats()
        assert stats["finished_timeout"] == 2
        await wait_idle(eng)
        assert_idle_and_clean(eng)


async def test_max_queue_time_ends_requests_that_wait_too_long() -> None:
    async with engine(max_running_requests=1, max_queue_time=0.01) as eng:
        first = asyncio.create_task(eng.generate(prompt(1), params(60)))
        await until(lambda: eng.stats()["running"] == 1)
        late = await eng.generate(prompt(2), params(5))
        assert late.finish_reason == "timeout" and late.token_ids == []
        assert (await first).finish_reason == "length"  # it started: the limit is over for it
        assert_idle_and_clean(eng)


@pytest.mark.parametrize(("policy", "bounded"), [("fair", True), ("fcfs", False)])
async def test_fairness_bounds_the_light_tenants_wait(policy: str, bounded: bool) -> None:
    async with engine(policy=policy, max_running_requests=2) as eng:
        heavy = [
            asyncio.create_task(
                eng.generate(prompt(k), params(8, tenant="heavy"), request_id=f"h{k}")
            )
            for k in range(24)
        ]
        await until(lambda: eng.stats()["running"] == 2)
        light = [
            asyncio.create_task(
                eng.generate(prompt(100 + k), params(8, tenant="light"), request_id=f"l{k}")
            )
            for k in range(2)
        ]
        outs = await asyncio.gather(*heavy, *light)
        started = sorted(outs, key=lambda o: o.metrics.arrival_time + (o.metrics.queue_time or 0))
        places = [i for i, o in enumerate(started) if o.request_id.startswith("l")]
        if bounded:  # the light tenant's requests go next to the heavy one's, not after them
            assert max(places) <= 6, places
        else:
            assert min(places) >= 20, places
        tenants = eng.stats()["tenants"]
        assert tenants["light"]["requests"] == 2 and tenants["heavy"]["requests"] == 24
        assert tenants["light"]["generated_tokens"] == 16
        assert_idle_and_clean(eng)


async def test_policy_swaps_mid_run_leak_nothing_and_keep_outputs_exact() -> None:
    async with engine(num_pages=48, chunked_prefill_size=8, max_running_requests=6) as eng:
        first = [
            asyncio.create_task(eng.generate(prompt(k, 9 + k), params(10 + k % 7)))
            for k in range(16)
        ]
        await until(lambda: eng.stats()["generated_tokens"] > 10)
        assert eng.set_policy("lpm+dynamic-chunking") == "fcfs"
        await until(lambda: eng.stats()["policy"] == "lpm+dynamic-chunking")
        second = [
            asyncio.create_task(eng.generate(prompt(50 + k, 9 + k), params(12, priority=k % 3)))
            for k in range(10)
        ]
        await until(lambda: eng.stats()["generated_tokens"] > 80)
        eng.set_policy("priority", {"preempt": True})
        with pytest.raises(ConfigError, match="unknown policy"):
            eng.set_policy("nope")
        outs = await asyncio.gather(*first, *second)
        for k, out in enumerate(outs[:16]):
            assert out.token_ids == reference_output(prompt(k, 9 + k), 10 + k % 7)
        for k, out in enumerate(outs[16:]):
            assert out.token_ids == reference_output(prompt(50 + k, 9 + k), 12)
        stats = eng.stats()
        assert stats["policy"] == "priority" and stats["policy_swaps"] == 2
        assert eng.config.policy == "priority"
        await wait_idle(eng)
        assert_idle_and_clean(eng)


async def _plans_and_outputs(
    **overrides: object,
) -> tuple[list[tuple[object, ...]], list[list[int]], dict]:
    eng = engine(delay=0.0, num_pages=40, chunked_prefill_size=8, policy="lpm", **overrides)
    plans: list[tuple[object, ...]] = []
    async with eng:
        eng.step_hooks.append(
            lambda plan: plans.append(
                tuple((s.rid, s.start_pos, s.num_tokens) for s in plan.segments)
            )
        )
        shared = prompt(7, 16)
        # every request arrives before the first step, so the plans depend on the policy only
        calls = [
            eng.generate(
                (shared if k % 2 else []) + prompt(k, 3 + k), params(5 + k % 4), request_id=f"r{k}"
            )
            for k in range(14)
        ]
        outs = await asyncio.gather(*calls)
        stats = eng.stats()
    return plans, [o.token_ids for o in outs], stats


@pytest.mark.parametrize("shadow", ["fcfs", "sjf", "fair"])
async def test_a_shadow_policy_never_changes_plans_or_outputs(shadow: str) -> None:
    plans, outputs, _ = await _plans_and_outputs()
    shadow_plans, shadow_outputs, stats = await _plans_and_outputs(shadow_policy=shadow)
    assert shadow_plans == plans and shadow_outputs == outputs
    assert stats["shadow"]["policy"] == shadow and stats["shadow"]["decisions"] > 0
