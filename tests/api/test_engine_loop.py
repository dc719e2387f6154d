"""The engine's event loop over a model-free executor: streaming, stops, abort, failures."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import weakref

import pytest

from asyncengine.api import engine as engine_module
from asyncengine.api.engine import AsyncEngine
from asyncengine.api.event_loop import run
from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import (
    EngineError,
    EngineNotRunningError,
    QueueFullError,
    RequestFailedError,
)
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.core.builder import build_core
from tests.fake_executor import EOS, FakeExecutor, reference_output


class CharTokenizer:
    """Token t renders as ``<t>``; text encodes one token per character."""

    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 998 + 1 for c in text]  # no special tokens to add

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

    def detokenizer(self, skip_special_tokens: bool, prompt_ids: list[int]) -> TagDetokenizer:
        return TagDetokenizer()


class TagDetokenizer:
    def __init__(self) -> None:
        self.text = ""

    def add(self, ids: list[int]) -> str:
        piece = "".join(f"<{t}>" for t in ids)
        self.text += piece
        return piece


def render(ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


class CheckedEngine(AsyncEngine):
    """An engine over the FakeExecutor that checks the KV invariant after every step."""

    async def start(self) -> AsyncEngine:
        await super().start()
        core = self.core
        assert core is not None
        if not core.step_hooks:
            core.step_hooks.append(lambda plan: core.check_invariant())
        return self


def fake_engine(
    num_pages: int = 128, page_size: int = 4, max_model_len: int = 256, **overrides: object
) -> AsyncEngine:
    values: dict[str, object] = {
        "page_size": page_size,
        "kv_cache_tokens": num_pages * page_size,
        "log_interval": 0,
        **overrides,
    }
    config = EngineConfig.from_dict(values)
    return CheckedEngine(config, executor=FakeExecutor(max_model_len), tokenizer=CharTokenizer())


def assert_idle_and_clean(engine: AsyncEngine) -> None:
    stats = engine.stats()
    assert stats["running"] == stats["prefilling"] == stats["waiting"] == 0, stats
    assert stats["pages_used"] == 0, stats
    assert (
        stats["pages_free"] + stats["pages_cached"] + stats["pages_tail"] == stats["pages_total"]
    ), stats
    # no request's stream bookkeeping outlives it (a kept group would refuse its id for good)
    assert engine.streams.groups == {} and engine.streams.states == {}


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        if not engine.scheduler.has_work():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("engine did not go idle")


async def test_generate_and_stream_concurrently() -> None:
    async with fake_engine() as engine:
        prompts = [[1 + i, 2, 3, 4 + i] * (i + 1) for i in range(8)]
        outs = await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(max_new_tokens=5 + i))
                for i, p in enumerate(prompts)
            )
        )
        for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
            expected = reference_output(p, 5 + i)
            assert out.token_ids == expected
            assert out.text == render(expected)
            assert out.finish_reason == "length"
            assert out.usage.prompt_tokens == len(p) and out.usage.completion_tokens == 5 + i
            assert out.metrics.ttft is not None and 0 <= out.metrics.ttft <= out.metrics.e2e
            assert len(out.metrics.itl) == 4 + i
        deltas = [d async for d in engine.stream([9, 8, 7], SamplingParams(max_new_tokens=6))]
        assert [t for d in deltas for t in d.token_ids] == reference_output([9, 8, 7], 6)
        assert deltas[-1].finished and deltas[-1].usage is not None
        await wait_idle(engine)
        assert_idle_and_clean(engine)


async def test_stop_string_cuts_text_and_frees_kv() -> None:
    async with fake_engine() as engine:
        prompt = [5, 6, 7, 8]
        expected = reference_output(prompt, 20)
        stop = f"<{expected[3]}>"
        cut = render(expected).index(stop)
        out = await engine.generate(prompt, SamplingParams(max_new_tokens=20, stop=[stop]))
        assert out.finish_reason == "stop" and out.matched_stop == stop
        assert out.text == render(expected)[:cut]
        streamed = "".join(
            [
                d.text
                async for d in engine.stream(prompt, SamplingParams(max_new_tokens=20, stop=stop))
            ]
        )
        assert streamed == out.text
        await wait_idle(engine)
        assert_idle_and_clean(engine)


async def test_a_stop_string_ending_on_the_last_allowed_token_is_a_stop() -> None:
    async with fake_engine() as engine:
        prompt = [5, 6, 7, 8]
        expected = reference_output(prompt, 4)
        stop = render(expected[2:4])
        out = await engine.generate(prompt, SamplingParams(max_new_tokens=4, stop=[stop]))
        assert (out.finish_reason, out.matched_stop) == ("stop", stop)
        assert out.text == render(expected[:2])


async def test_min_new_tokens_holds_back_stop_strings_that_end_before_it() -> None:
    async with fake_engine() as engine:
        prompt = [5, 6, 7, 8]
        expected = reference_output(prompt, 6)
        assert len(set(expected)) == 6  # each stop below can match in one place only
        stop = render(expected[1:3])  # spans tokens 2 and 3: it ends on the 3rd
        for minimum, reason, text in [
            (3, "stop", render(expected[:1])),
            (4, "length", render(expected)),
        ]:
            params = SamplingParams(max_new_tokens=6, min_new_tokens=minimum, stop=[stop])
            out = await engine.generate(prompt, params)
            assert (out.finish_reason, out.text) == (reason, text)
            streamed = [d async for d in engine.stream(prompt, params)]
            assert "".join(d.text for d in streamed) == text
            assert streamed[-1].finish_reason == reason
        await wait_idle(engine)
        assert_idle_and_clean(engine)


async def test_chat_messages_and_text_prompts() -> None:
    async with fake_engine() as engine:
        out = await engine.generate(
            [{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=3)
        )
        tok = CharTokenizer()
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
        assert out.token_ids == reference_output(ids, 3)
        out = await engine.generate("hello", SamplingParams(max_new_tokens=2))
        assert out.token_ids == reference_output(tok.encode("hello"), 2)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "empty"),
        ([], "non-empty"),
        ([1, 2, 5000], "outside the vocabulary"),
        (list(range(1, 300)), "no room to generate"),
        ([{"role": "user"}], "message 0"),
        ([1, "a"], "only token ids"),
    ],
)
async def test_bad_input_raises_before_queueing(prompt: object, message: str) -> None:
    async with fake_engine() as engine:
        with pytest.raises(InvalidRequestError, match=message):
            engine.stream(prompt, SamplingParams())  # type: ignore[arg-type]
        assert engine.stats()["waiting"] == 0


def test_bad_sampling_params_raise() -> None:
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


@pytest.mark.parametrize("name", ["ignore_eos", "logprobs", "skip_special_tokens"])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(name: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"{name}='no': must be True or False"):
        SamplingParams(**{name: "no"})  # type: ignore[arg-type]


async def test_cancel_and_early_exit_abort_without_leaks() -> None:
    rng = random.Random(5)
    async with fake_engine(num_pages=64, chunked_prefill_size=8, max_prefill_tokens=16) as engine:
        keep = [[rng.randrange(1, 999) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
        keep_tasks = [
            asyncio.create_task(engine.generate(p, SamplingParams(max_new_tokens=12))) for p in keep
        ]
        doomed = [
            asyncio.create_task(
                engine.generate(
                    [rng.randrange(1, 999) for _ in range(30)], SamplingParams(max_new_tokens=50)
                )
            )
            for _ in range(6)
        ]
        for task in doomed:
            for _ in range(rng.randrange(0, 6)):
                await asyncio.sleep(0)
            task.cancel()
        stream = engine.stream([4, 4, 4], SamplingParams(max_new_tokens=40))
        async for _ in stream:
            break
        await stream.aclose()
        rid = "explicit"
        explicit = asyncio.create_task(
            engine.generate([7, 7, 7], SamplingParams(max_new_tokens=40), request_id=rid)
        )
        await asyncio.sleep(0.001)
        assert engine.abort(rid)
        assert (await explicit).finish_reason == "abort"
        outs = await asyncio.gather(*keep_tasks)
        for p, out in zip(keep, outs, strict=True):
            assert out.token_ids == reference_output(p, 12)
        for task in doomed:
            with pytest.raises(asyncio.CancelledError):
                await task
        await wait_idle(engine)
        assert_idle_and_clean(engine)


async def test_failed_forward_fails_its_batch_and_engine_keeps_serving() -> None:
    engine = fake_engine()
    async with engine:
        runner = engine.executor  # type: ignore[union-attr]
        runner.fail_on_step = runner.steps + 1
        with pytest.raises(RequestFailedError, match="injected"):
            await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4), request_id="r")
        # the failed request's id is free again, as after any other end
        out = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4), request_id="r")
        assert out.token_ids == reference_output([1, 2, 3], 4)
        assert engine.is_running
        await wait_idle(engine)
        assert_idle_and_clean(engine)


async def test_choices_waiting_on_a_leader_that_times_out_end_with_it() -> None:
    """n > 1: the other choices wait in the core for choice 0 to prefill; when choice 0 times
    out in the queue first, they end with it and the caller gets every final delta."""
    async with fake_engine(num_pages=1024, max_model_len=2048, max_running_requests=1) as engine:
        long = SamplingParams(max_new_tokens=1500)  # far longer than the others' timeout
        busy = asyncio.create_task(engine.generate([9, 9, 9], long))
        await wait_until_running(engine)
        params = SamplingParams(n=3, max_new_tokens=4, timeout=0.02)
        outs = await asyncio.wait_for(engine.generate_choices([1, 2, 3], params), 10)
        assert [out.finish_reason for out in outs] == ["timeout"] * 3
        assert (await busy).finish_reason == "length"
        await wait_idle(engine)
        assert_idle_and_clean(engine)


async def wait_until_running(engine: AsyncEngine) -> None:
    for _ in range(400):
        if engine.stats()["running"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("nothing started running")


async def test_queue_bound_raises_queue_full() -> None:
    async with fake_engine(max_waiting_requests=2) as engine:
        streams = [engine.stream([1, 2], SamplingParams(max_new_tokens=2)) for _ in range(2)]
        with pytest.raises(QueueFullError):
            engine.stream([1, 2], SamplingParams(max_new_tokens=2))
        for s in streams:
            [d async for d in s]


async def test_idle_loop_does_not_spin() -> None:
    async with fake_engine() as engine:
        await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
        steps = engine.scheduler.step_count
        await asyncio.sleep(0.05)
        assert engine.scheduler.step_count == steps


async def test_shared_prefix_hits_show_in_stats_and_usage() -> None:
    async with fake_engine(page_size=4) as engine:
        system = list(range(1, 33))
        first = await engine.generate(system + [40, 41], SamplingParams(max_new_tokens=3))
        assert first.usage.cached_tokens == 0
        second = await engine.generate(system + [50, 51], SamplingParams(max_new_tokens=3))
        assert second.usage.cached_tokens == 32
        assert second.metrics.cached_tokens == 32 and first.metrics.cached_tokens == 0
        assert second.token_ids == reference_output(system + [50, 51], 3)
        stats = engine.stats()
        assert stats["hit_tokens"] >= 32 and 0 < stats["cache_hit_rate"] < 1


async def test_reset_prefix_cache_only_while_idle() -> None:
    async with fake_engine() as engine:
        await engine.generate(list(range(1, 40)), SamplingParams(max_new_tokens=2))
        assert engine.stats()["pages_cached"] > 0
        stream = engine.stream([1, 2, 3], SamplingParams(max_new_tokens=50))
        with pytest.raises(EngineError, match="while requests"):
            await engine.reset_prefix_cache()
        await stream.aclose()
        await wait_idle(engine)
        assert engine.stats()["finished_length"] == 1 and engine.stats()["tenants"]
        await engine.reset_prefix_cache(reset_counters=True)
        stats = engine.stats()
        assert stats["pages_cached"] == 0 and stats["hit_tokens"] == 0
        assert stats["finished_length"] == stats["finished_abort"] == stats["steps"] == 0
        assert stats["tenants"] == {} and stats["prompt_tokens"] == 0
        assert stats["pages_free"] == stats["pages_total"]


async def test_request_id_reused_while_the_aborted_step_runs() -> None:
    """Abort a request while its forward runs, then reuse its id at once: the new request gets
    its own tokens only, and the engine keeps serving (the old step's chunk once crashed it)."""
    async with fake_engine(chunked_prefill_size=8, max_prefill_tokens=8) as engine:
        runner = engine.executor  # type: ignore[union-attr]
        gate = threading.Event()
        execute = runner.execute

        def gated(plan):  # type: ignore[no-untyped-def]
            gate.wait(10)
            return execute(plan)

        runner.execute = gated
        first = asyncio.create_task(
            engine.generate(list(range(1, 40)), SamplingParams(max_new_tokens=5), request_id="dup")
        )
        for _ in range(200):
            if engine.scheduler.inflight is not None:
                break
            await asyncio.sleep(0.001)
        assert engine.scheduler.inflight is not None  # its first chunk is in the forward now
        assert engine.abort("dup")
        assert (await first).finish_reason == "abort"
        second = asyncio.create_task(
            engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4), request_id="dup")
        )
        await asyncio.sleep(0.01)
        gate.set()
        out = await second
        assert out.token_ids == reference_output([5, 6, 7], 4)
        assert engine.is_running
        await wait_idle(engine)
        assert_idle_and_clean(engine)


def test_run_helper_uses_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")  # a dependency on every platform but Windows

    async def which_loop() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(run(which_loop()), uvloop.Loop)


def test_context_is_capped_by_what_the_kv_pool_holds() -> None:
    """A prompt the KV pool can never hold is refused up front: the pool caps max_model_len."""
    config = EngineConfig(page_size=4, kv_cache_tokens=64)
    core = build_core(config, FakeExecutor(max_model_len=4096))
    assert core.max_model_len == 64 and core.kv.num_pages == 16
    assert core.kv.max_pages_per_row == 16
    capped = build_core(config.replace(max_model_len=32), FakeExecutor(max_model_len=4096))
    assert capped.max_model_len == 32


async def test_prompt_at_the_pool_capped_context_is_refused() -> None:
    async with fake_engine(num_pages=16, page_size=4, max_model_len=64) as engine:
        with pytest.raises(InvalidRequestError, match="64 tokens"):
            engine.stream(list(range(1, 65)), SamplingParams())
        out = await engine.generate(list(range(1, 64)), SamplingParams(max_new_tokens=8))
        assert out.finish_reason == "length" and len(out.token_ids) == 1


@pytest.mark.parametrize("overlap", [True, False])
async def test_overlap_launches_the_next_forward_before_streaming_this_step(
    overlap: bool,
) -> None:
    """With overlap, when a step's tokens are streamed (its hook runs) the next plan is already
    scheduled and its forward launched; without, nothing is in flight then. Outputs, stop
    strings and KV accounting are the same either way."""
    async with fake_engine(enable_overlap_schedule=overlap) as engine:
        in_flight_at_hook: list[tuple[int, int | None]] = []
        engine.step_hooks.append(
            lambda plan: in_flight_at_hook.append(
                (
                    plan.step,
                    None if engine.scheduler.inflight is None else engine.scheduler.inflight.step,
                )
            )
        )
        prompts = [[5 + i, 6, 7] * (i + 2) for i in range(6)]
        expected = [reference_output(p, 8 + i) for i, p in enumerate(prompts)]
        stop = f"<{expected[0][4]}>"  # request 0 stops on its 5th token, mid-flight
        outs = await asyncio.gather(
            engine.generate(prompts[0], SamplingParams(max_new_tokens=8, stop=[stop])),
            *(
                engine.generate(p, SamplingParams(max_new_tokens=8 + i))
                for i, p in enumerate(prompts[1:], start=1)
            ),
        )
        assert outs[0].finish_reason == "stop" and outs[0].token_ids == expected[0][:5]
        for out, want in zip(outs[1:], expected[1:], strict=True):
            assert out.token_ids == want and out.finish_reason == "length"
        await wait_idle(engine)
        assert_idle_and_clean(engine)
    launched_early = [nxt for step, nxt in in_flight_at_hook if nxt is not None]
    if overlap:
        # every step but the last had its successor in flight while it streamed
        assert [nxt for _, nxt in in_flight_at_hook[:-1]] == [
            s + 1 for s, _ in in_flight_at_hook[:-1]
        ]
        assert in_flight_at_hook[-1][1] is None
    else:
        assert launched_early == []


async def test_a_stopped_engine_dropped_by_its_caller_is_collected() -> None:
    """start() freezes the objects alive (shorter collector passes while serving); stop() must
    unfreeze them, or a dropped engine's pool and weights (on a GPU: the memory a second engine
    in the process sizes its pool from) could never be collected."""
    engine = fake_engine()
    await engine.start()
    out = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
    assert len(out.token_ids) == 4
    await engine.stop()
    core = weakref.ref(engine.core)
    del engine
    gc.collect()
    assert core() is None


async def test_leaving_async_with_lets_go_of_the_core_and_a_start_builds_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() (the end of ``async with``): the core (model, KV pool) is gone at once while the
    caller still holds the engine, not when the collector gets to its cycles, and the memory the
    steps kept goes back; the engine starts again on a new core."""
    engine = fake_engine()
    given_back: list[bool] = []
    monkeypatch.setattr(engine_module, "give_back_freed_memory", lambda: given_back.append(True))
    async with engine:
        out = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
        core = weakref.ref(engine.core)
    assert engine.core is None
    assert core() is None
    assert given_back == [True]  # and the C heap's freed pages handed back to the OS
    async with engine:
        again = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
        assert engine.core is not None and engine.core is not core()
    assert again.token_ids == out.token_ids


def test_a_config_of_the_wrong_type_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        AsyncEngine("lpm")  # type: ignore[arg-type]


async def test_a_call_from_another_event_loop_is_refused_before_queueing() -> None:
    """The engine's state belongs to the loop that started it: a coroutine on another loop (in
    another thread) gets a clear error and queues nothing; run_coroutine_threadsafe works."""
    async with fake_engine() as engine:
        loop = asyncio.get_running_loop()

        def from_another_loop() -> BaseException | None:
            async def go() -> None:
                # bounded: a delta handed over from the engine's thread may never wake this loop
                await asyncio.wait_for(
                    engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4)), 30
                )

            try:
                asyncio.run(go())
            except BaseException as exc:
                return exc
            return None

        error = await loop.run_in_executor(None, from_another_loop)
        assert isinstance(error, EngineError) and "run_coroutine_threadsafe" in str(error)
        assert_idle_and_clean(engine)

        def via_the_engines_loop() -> list[int]:
            coro = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
            return asyncio.run_coroutine_threadsafe(coro, loop).result().token_ids

        out = await loop.run_in_executor(None, via_the_engines_loop)
        assert out == reference_output([5, 6, 7], 4)


def test_an_engine_whose_loop_ended_unclosed_closes_and_starts_on_another_loop() -> None:
    engine = fake_engine()
    asyncio.run(engine.start())  # the loop ends, cancelling the step loop's task

    async def on_another_loop() -> list[int]:
        with pytest.raises(EngineError, match="not running"):
            await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
        await engine.close()
        async with engine:
            out = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
        return out.token_ids

    assert asyncio.run(on_another_loop()) == reference_output([5, 6, 7], 4)


async def test_a_failed_start_leaves_no_forward_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_core(*args: object, **kwargs: object) -> None:
        raise OSError("no model here")

    monkeypatch.setattr(engine_module, "build_core", no_core)
    engine = fake_engine()
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="no model here"):
        await engine.start()
    assert not engine.is_running
    assert set(threading.enumerate()) - before == set()


async def test_a_request_to_an_engine_not_started_says_how_to_start_it() -> None:
    engine = fake_engine()
    for call in (
        lambda: engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4)),
        lambda: engine.embed([5, 6, 7]),
    ):
        with pytest.raises(EngineNotRunningError, match=r"await engine\.start\(\)"):
            await call()
