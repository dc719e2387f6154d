"""The rest of the OpenAI surface with the real client: logit_bias, user, stop as a string on
chat, max_completion_tokens with include_usage. (Seeds, penalties, stop lists, top_logprobs and
stream usage are in test_server_openai.py; tool calls in test_tool_calls.py.)"""

from __future__ import annotations

import openai
import pytest

from asyncengine.common.sampling_params import SamplingParams
from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import (
    RunningServer,
    assert_no_leak,
    engine_idle,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

MESSAGES = [{"role": "user", "content": "Name a colour."}]


async def test_logit_bias_steers_and_bans(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    base = await client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=4, temperature=0
    )
    same = await server.engine.generate(MESSAGES, SamplingParams(max_new_tokens=4, temperature=0))
    assert same.text == base.choices[0].message.content
    first = same.token_ids[0]
    tokenizer = server.engine.tokenizer
    banned = await client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logit_bias={str(first): -100},
        user="user-1234",  # accepted and ignored
    )
    assert banned.choices[0].message.content != base.choices[0].message.content
    forced_id = tokenizer.encode(" blue")[0]
    forced = await client.completions.create(
        model=server.model,
        prompt="My favourite colour is",
        max_tokens=3,
        temperature=1.0,
        seed=0,
        logit_bias={str(forced_id): 100},
    )
    assert forced.choices[0].text == tokenizer.decode([forced_id] * 3)


async def test_chat_stop_string_and_max_completion_tokens(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    full = await server.engine.generate(
        MESSAGES, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    )
    stop = next(
        full.text[i : i + 2]
        for i in range(2, len(full.text) - 2)
        if full.text[i : i + 2].isascii() and full.text[i : i + 2].strip()
    )
    resp = await client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_completion_tokens=20,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == full.text[: full.text.find(stop)]
    stream = await client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


async def test_nothing_leaks_after_the_module(server: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)
