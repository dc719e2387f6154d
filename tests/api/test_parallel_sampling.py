"""n > 1: the prompt is prefilled once and forked through the radix cache; seeded choices are
distinct and reproducible; streams interleave choices by index; usage counts the prompt once;
logprobs come per choice; on the Python API, both OpenAI endpoints and /generate."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import openai
import pytest

from asyncengine import AsyncEngine
from asyncengine.common.errors import InvalidRequestError
from asyncengine.common.plan import BatchPlan
from asyncengine.common.sampling_params import SamplingParams, choice_seed
from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import (
    RunningServer,
    assert_no_leak,
    engine_config,
    engine_idle,
    sse_json,
    tiny_model_dir,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

PAGE = 16  # engine_config's page_size
PROMPT = "Write a short story about a cache that never forgets."


def sampled(n: int, max_new_tokens: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(n=n, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("length", [100, 96])
async def test_prompt_is_prefilled_once_and_forked(
    tmp_path_factory: pytest.TempPathFactory, length: int
) -> None:
    # In-batch prefix dedup and in-step sharing off: the scheduler would defer same-prefix
    # prompts (or share them in the step) by itself; the engine forks n choices whatever the
    # scheduling options.
    config = engine_config(
        tiny_model_dir(tmp_path_factory),
        enable_inbatch_prefix_dedup=False,
        enable_in_step_prefix_sharing=False,
    )
    async with AsyncEngine(config) as engine:
        await _check_fork(engine, length)


async def _check_fork(engine: AsyncEngine, length: int) -> None:
    prompt = [random.Random(length).randrange(3, 40000) for _ in range(length)]
    extend_tokens: list[int] = []

    def count(plan: BatchPlan) -> None:
        extend_tokens.append(sum(seg.num_tokens for seg in plan.extends))

    hits_before = engine.stats()["hit_tokens"]
    engine.step_hooks.append(count)
    try:
        outputs = await engine.generate_choices(prompt, sampled(4, seed=3))
    finally:
        engine.step_hooks.remove(count)
    # choice 0 computes the prompt; the others take its whole pages from the cache and compute
    # only the rest (at least the last token, whose logits they sample from)
    shared = (length - 1) // PAGE * PAGE
    assert sum(extend_tokens) == length + 3 * (length - shared)
    assert engine.stats()["hit_tokens"] - hits_before == 3 * shared
    assert [o.usage.cached_tokens for o in outputs] == [0, shared, shared, shared]
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 12 for o in outputs)


async def test_seeded_choices_are_distinct_and_reproducible(server: RunningServer) -> None:
    engine = server.engine
    first = await engine.generate_choices(PROMPT, sampled(3, seed=11))
    again = await engine.generate_choices(PROMPT, sampled(3, seed=11))
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) == 3
    # choice i samples as a lone request seeded with choice_seed(seed, i) (choice 0: the seed)
    alone0 = await engine.generate(PROMPT, sampled(1, seed=11))
    alone2 = await engine.generate(PROMPT, sampled(1, seed=choice_seed(11, 2)))
    assert alone0.token_ids == first[0].token_ids
    assert alone2.token_ids == first[2].token_ids


async def test_n_is_capped_and_generate_wants_one_choice(server: RunningServer) -> None:
    engine = server.engine
    with pytest.raises(InvalidRequestError, match="max_n=16"):
        engine.stream(PROMPT, sampled(17))
    with pytest.raises(InvalidRequestError, match="generate_choices"):
        await engine.generate(PROMPT, sampled(2))


async def test_stream_interleaves_choices_and_abort_ends_them_all(server: RunningServer) -> None:
    engine = server.engine
    stream = engine.stream(PROMPT, sampled(3, max_new_tokens=40, seed=1))
    indexes = []
    async for delta in stream:
        indexes.append(delta.index)
        if len(indexes) == 12:
            break
    await stream.aclose()
    assert set(indexes) == {0, 1, 2}
    assert indexes != sorted(indexes), "choices decode side by side, so their deltas interleave"
    assert await wait_until(lambda: engine_idle(engine))
    assert not engine.streams.groups and not engine.streams.states


async def test_chat_n_usage_and_logprobs(client: openai.AsyncOpenAI, server: RunningServer) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    one = await client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=6, seed=5
    )
    resp = await client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=6,
        n=3,
        seed=5,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) > 1
    assert resp.usage is not None and one.usage is not None
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert resp.usage.completion_tokens == 18
    for choice in resp.choices:
        assert choice.logprobs is not None and len(choice.logprobs.content or []) == 6
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content or [])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_stream_n_matches_non_stream(
    client: openai.AsyncOpenAI, server: RunningServer, endpoint: str
) -> None:
    common = {
        "model": server.model,
        "max_tokens": 10,
        "n": 3,
        "seed": 9,
        "extra_body": {"ignore_eos": True},
    }
    if endpoint == "chat":
        create = client.chat.completions.create
        common["messages"] = [{"role": "user", "content": "Tell me more."}]
    else:
        create = client.completions.create
        common["prompt"] = PROMPT
    full = await create(**common)
    chunks = [
        c async for c in await create(stream=True, stream_options={"include_usage": True}, **common)
    ]
    texts = ["", "", ""]
    finishes: list[list[str]] = [[], [], []]
    order = []
    for chunk in chunks:
        for choice in chunk.choices:
            order.append(choice.index)
            piece = choice.delta.content if endpoint == "chat" else choice.text
            texts[choice.index] += piece or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    expected = [c.message.content if endpoint == "chat" else c.text for c in full.choices]
    assert texts == expected
    assert finishes == [["length"]] * 3
    assert order != sorted(order)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 30
    assert full.usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


async def test_generate_n(server: RunningServer) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {"n": 2, "max_new_tokens": 5, "ignore_eos": True, "seed": 4},
    }
    async with aiohttp.ClientSession(server.base_url) as http:
        async with http.post("/generate", json=body) as resp:
            assert resp.status == 200
            bodies = await resp.json()
        async with http.post("/generate", json={**body, "stream": True}) as resp:
            frames = sse_json(await resp.read())
    assert [b["index"] for b in bodies] == [0, 1]
    assert all(len(b["output_ids"]) == 5 for b in bodies)
    assert bodies[0]["output_ids"] != bodies[1]["output_ids"]
    last = {frame["index"]: frame for frame in frames}
    joined = [[t for f in frames if f["index"] == i for t in f["output_ids"]] for i in (0, 1)]
    assert joined == [b["output_ids"] for b in bodies]  # each frame: its new ids
    assert all(last[i]["meta_info"]["finish_reason"]["type"] == "length" for i in (0, 1))


async def test_without_prefix_cache_every_choice_prefills(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from asyncengine import AsyncEngine

    config = engine_config(tiny_model_dir(tmp_path_factory), enable_prefix_cache=False)
    async with AsyncEngine(config) as engine:
        outputs = await engine.generate_choices(PROMPT, sampled(3, seed=2))
        await asyncio.sleep(0)
        assert [o.usage.cached_tokens for o in outputs] == [0, 0, 0]
        assert len({tuple(o.token_ids) for o in outputs}) == 3


async def test_nothing_leaks_after_the_module(server: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)
