"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` over loopback: a count
is what a completion or chat completion of the same input reports as ``usage.prompt_tokens``,
ids decode back to the text they were made from, bad input is a 4xx with the usual error body,
and the routes sit behind the API key like the others."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

import asyncengine
from tests.openai_server import bos_client, bos_server, client, server  # noqa: F401  (fixtures)
from tests.server_support import BOS, MAX_MODEL_LEN, RunningServer, start_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXT = "The story goes on, café ☕ and 東京."
USER: Any = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def _call(
    server: RunningServer,
    path: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """``body`` POSTed to ``path`` (None: a GET), answered with its status and JSON."""
    async with aiohttp.ClientSession() as session:
        method = "GET" if body is None else "POST"
        async with session.request(
            method, server.base_url + path, json=body, headers=headers
        ) as response:
            return response.status, await response.json()


async def _tokenize(server: RunningServer, **body: Any) -> dict[str, Any]:
    status, answer = await _call(server, "/tokenize", body)
    assert status == 200, answer
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == MAX_MODEL_LEN
    return dict(answer)


async def _detokenize(server: RunningServer, tokens: list[int]) -> str:
    status, answer = await _call(server, "/detokenize", {"tokens": tokens})
    assert status == 200, answer
    return str(answer["prompt"])


async def _chat_prompt_tokens(client: openai.AsyncOpenAI, model: str, **fields: Any) -> int:
    messages = fields.pop("messages", USER)
    tools = fields.pop("tools", openai.NOT_GIVEN)
    reply = await client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=1, extra_body=fields
    )
    assert reply.usage is not None
    return reply.usage.prompt_tokens


async def test_a_prompts_count_is_what_a_completion_reports(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    answer = await _tokenize(server, prompt=TEXT, model=server.model)
    done = await client.completions.create(model=server.model, prompt=TEXT, max_tokens=1)
    assert done.usage is not None and answer["count"] == done.usage.prompt_tokens
    assert answer["tokens"] == server.engine.tokenizer.encode(TEXT)
    assert answer["token_strs"] is None


async def test_messages_count_what_a_chat_completion_reports(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """The same rendering: the tools written into the prompt, the reply's opening left out,
    the final message left open."""
    prefilled = [*USER, {"role": "assistant", "content": "The capital is"}]
    variants: dict[str, dict[str, Any]] = {
        "plain": {},
        "tools": {"tools": TOOLS},
        "no opening": {"add_generation_prompt": False},
        "continued": {"messages": prefilled, "continue_final_message": True},
    }
    counts = {}
    for name, fields in variants.items():
        answer = await _tokenize(server, **{"messages": USER, **fields})
        counts[name] = answer["count"]
        assert counts[name] == await _chat_prompt_tokens(client, server.model, **fields), name
    assert counts["tools"] > counts["plain"] + 10
    assert counts["no opening"] < counts["plain"]
    assert counts["continued"] > counts["plain"]


async def test_detokenize_gives_back_the_text_the_ids_were_made_from(
    server: RunningServer,
) -> None:
    special = "<|im_start|>user\nhi<|im_end|>"  # special tokens come back as their text
    for text in (TEXT, "  two spaces,\ta tab\n", special):
        answer = await _tokenize(server, prompt=text)
        assert await _detokenize(server, answer["tokens"]) == text
    chat = await _tokenize(server, messages=USER)
    rendered = server.engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    assert await _detokenize(server, chat["tokens"]) == rendered
    assert await _detokenize(server, []) == ""


async def test_add_special_tokens_is_honoured(
    bos_client: openai.AsyncOpenAI, bos_server: RunningServer
) -> None:
    """Left out it is true for a prompt and false for messages, as on the completions and the
    chat completions (and in vLLM); true puts the BOS first, as a completion or chat
    completion with it counts it."""
    bos = bos_server.engine.tokenizer.encode(BOS)
    plain = await _tokenize(bos_server, prompt=TEXT, add_special_tokens=False)
    special = await _tokenize(bos_server, prompt=TEXT, add_special_tokens=True)
    assert special["tokens"] == bos + plain["tokens"]
    assert (await _tokenize(bos_server, prompt=TEXT)) == special
    for answer, extra in (
        (plain, {"add_special_tokens": False}),
        (special, {"add_special_tokens": True}),
        (special, {}),
    ):
        done = await bos_client.completions.create(
            model=bos_server.model, prompt=TEXT, max_tokens=1, extra_body=extra
        )
        assert done.usage is not None and answer["count"] == done.usage.prompt_tokens
    assert await _detokenize(bos_server, special["tokens"]) == BOS + TEXT
    # SGLang's /generate tokenizes a text the same way
    status, generated = await _call(
        bos_server, "/generate", {"text": TEXT, "sampling_params": {"max_new_tokens": 1}}
    )
    assert status == 200, generated
    assert generated["meta_info"]["prompt_tokens"] == special["count"]
    chat = await _tokenize(bos_server, messages=USER)
    chat_special = await _tokenize(bos_server, messages=USER, add_special_tokens=True)
    assert chat_special["tokens"] == bos + chat["tokens"]
    model = bos_server.model
    assert chat["count"] == await _chat_prompt_tokens(bos_client, model)
    with_bos = await _chat_prompt_tokens(bos_client, model, add_special_tokens=True)
    assert chat_special["count"] == with_bos


async def test_chat_template_kwargs_reach_the_template(
    bos_client: openai.AsyncOpenAI, bos_server: RunningServer
) -> None:
    kwargs = {"documents": [{"title": "Moon", "text": "The moon is made of rock and dust."}]}
    alone = await _tokenize(bos_server, messages=USER)
    answer = await _tokenize(bos_server, messages=USER, chat_template_kwargs=kwargs)
    assert answer["count"] > alone["count"] + 8
    model = bos_server.model
    assert answer["count"] == await _chat_prompt_tokens(
        bos_client, model, chat_template_kwargs=kwargs
    )


async def test_return_token_strs_names_each_token_as_the_vocabulary_does(
    server: RunningServer,
) -> None:
    answer = await _tokenize(server, prompt="hello world", return_token_strs=True)
    assert answer["token_strs"] == ["hello", "Ġworld"]
    chat = await _tokenize(server, messages=USER, return_token_strs=True)
    assert chat["token_strs"][0] == "<|im_start|>" and len(chat["token_strs"]) == chat["count"]
    long = await _tokenize(server, prompt="hello world " * 2000, return_token_strs=True)
    assert long["token_strs"][:3] == ["hello", "Ġworld", "Ġhello"]
    assert len(long["token_strs"]) == long["count"] > 2000
    assert await _detokenize(server, long["tokens"]) == "hello world " * 2000


OUT_OF_VOCABULARY = 49152  # the tiny model's vocabulary size

BAD: list[tuple[str, dict[str, Any], int, str]] = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": USER}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "nobody", "content": "hi"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "tools"),
    ("/tokenize", {"prompt": "a", "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": USER, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    (
        "/tokenize",
        {"messages": USER, "add_generation_prompt": True, "continue_final_message": True},
        400,
        "add_generation_prompt",
    ),
    (
        "/tokenize",
        {"messages": USER, "chat_template_kwargs": {"tools": []}},
        400,
        "chat_template_kwargs",
    ),
    ("/tokenize", {"prompt": "a", "model": "no-such-model"}, 404, "model"),
    ("/tokenize", {"messages": USER, "model": "no-such-model"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 2.5]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1, OUT_OF_VOCABULARY]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**30]}, 400, "tokens"),
    # enough ids to be decoded off the event loop (server/off_loop.py): refused there
    ("/detokenize", {"tokens": [1] * 5000 + [OUT_OF_VOCABULARY]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "no-such-model"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
async def test_bad_input_is_a_4xx_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    got, answer = await _call(server, path, body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"


async def test_the_version_is_the_packages(server: RunningServer) -> None:
    assert await _call(server, "/version") == (200, {"version": asyncengine.__version__})


async def test_tokenizing_needs_the_key_and_the_body_limit_holds(server: RunningServer) -> None:
    """As /v1/*: without the key a 401, with it an answer; /version stays open, as the
    version is in the open /openapi.json too."""
    guarded = await start_server(
        server.engine.config, engine=server.engine, api_key="s3cret", max_body_bytes=4096
    )
    key = {"Authorization": "Bearer s3cret"}
    try:
        for path, body in (("/tokenize", {"prompt": TEXT}), ("/detokenize", {"tokens": [1]})):
            status, answer = await _call(guarded, path, body)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
            assert (await _call(guarded, path, body, key))[0] == 200
        assert (await _call(guarded, "/version"))[0] == 200
        status, answer = await _call(guarded, "/tokenize", {"prompt": "a" * 5000}, key)
        assert status == 413 and answer["error"]["message"]
    finally:
        await guarded.stop(stop_engine=False)
