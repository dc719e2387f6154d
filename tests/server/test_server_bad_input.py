"""Bad requests get the documented 4xx with an OpenAI-style error naming the problem, never a 500
or a hung connection, and the server stays healthy. Also: body size limit and a full queue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.server_support import (
    MAX_MODEL_LEN,
    RunningServer,
    assert_no_leak,
    engine_config,
    engine_idle,
    start_server,
    tiny_model_dir,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MAX_BODY_BYTES = 64 * 1024
MAX_NEW_TOKENS_LIMIT = 300
BODY_TIMEOUT = 1.0
USER = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: Any  # a dict/list/str is sent as JSON; bytes as they are
    status: int = 400
    param: str | None = None  # expected error.param, when the error is about one field
    says: str = ""  # a fragment the message must contain
    method: str = "POST"
    content_type: str | None = "application/json"  # None: no Content-Type header
    # how the body travels: "json" (one request, Content-Length), "chunked-stall" (chunked
    # transfer that sends a few bytes and then nothing), "stream" (a body too large to hold:
    # written in pieces while the answer is read)
    transport: str = "json"


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def native(**sampling: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **sampling}}


LONG_TEXT = "word " * (MAX_MODEL_LEN + 50)

CASES = [
    # not JSON / not an object
    Bad("malformed json", CHAT, b'{"messages": [', says="not valid JSON"),
    Bad("empty body", CHAT, b"", says="empty"),
    Bad("invalid utf-8", CHAT, b"\xff\xfe{}", says="not valid JSON"),
    Bad("NaN literal", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', says="not valid JSON"),
    Bad("array body", CHAT, [1, 2], says="Expected `object`"),
    Bad("string body", COMPLETIONS, "hello", says="Expected `object`"),
    # chat messages
    Bad("missing messages", CHAT, {"max_tokens": 2}, param="messages", says="messages"),
    Bad("empty messages", CHAT, chat(messages=[]), param="messages", says="length >= 1"),
    Bad("messages not a list", CHAT, chat(messages="hi"), param="messages"),
    Bad("message is a string", CHAT, chat(messages=["hi"]), param="messages[0]"),
    Bad("message without role", CHAT, chat(messages=[{"content": "hi"}]), param="messages[0].role"),
    Bad(
        "unknown role",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        param="messages[0].role",
    ),
    Bad(
        "content is a number",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        param="messages[0].content",
    ),
    Bad(
        "user content missing", CHAT, chat(messages=[{"role": "user"}]), param="messages[0].content"
    ),
    Bad(
        "image content part",
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        param="messages[0].content[0].type",
        says="only text",
    ),
    Bad(
        "refusal part from the user",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]),
        param="messages[0].content[0].type",
        says="only text",
    ),
    Bad(
        "prompt too long",
        CHAT,
        chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        says="max_model_len",
    ),
    # sampling fields: types and ranges
    Bad("max_tokens zero", CHAT, chat(max_tokens=0), param="max_tokens", says=">= 1"),
    Bad("max_tokens negative", COMPLETIONS, completion(max_tokens=-5), param="max_tokens"),
    Bad("max_tokens string", CHAT, chat(max_tokens="ten"), param="max_tokens", says="got `str`"),
    Bad("max_tokens float", CHAT, chat(max_tokens=1.5), param="max_tokens", says="got `float`"),
    Bad(
        "max_completion_tokens zero",
        CHAT,
        chat(max_completion_tokens=0),
        param="max_completion_tokens",
    ),
    Bad("temperature negative", CHAT, chat(temperature=-1), param="temperature"),
    Bad(
        "temperature too high",
        COMPLETIONS,
        completion(temperature=3),
        param="temperature",
        says="<= 2.0",
    ),
    Bad("temperature string", CHAT, chat(temperature="hot"), param="temperature"),
    Bad("temperature bool", CHAT, chat(temperature=True), param="temperature", says="got `bool`"),
    Bad("top_p zero", CHAT, chat(top_p=0), param="top_p"),
    Bad("top_p above one", COMPLETIONS, completion(top_p=1.5), param="top_p"),
    Bad("top_k below -1", CHAT, chat(top_k=-2), param="top_k"),
    Bad("min_p above one", CHAT, chat(min_p=2), param="min_p"),
    Bad("presence_penalty", CHAT, chat(presence_penalty=5), param="presence_penalty"),
    Bad(
        "frequency_penalty",
        COMPLETIONS,
        completion(frequency_penalty=-3),
        param="frequency_penalty",
    ),
    Bad("repetition_penalty zero", CHAT, chat(repetition_penalty=0), param="repetition_penalty"),
    Bad("n above max_n", CHAT, chat(n=17), param="n", says="max_n=16"),
    Bad("n zero", CHAT, chat(n=0), param="n"),
    Bad("stop number", CHAT, chat(stop=5), param="stop"),
    Bad("stop empty string", COMPLETIONS, completion(stop=[""]), param="stop"),
    Bad("too many stops", CHAT, chat(stop=[f"s{i}" for i in range(17)]), says="at most 16"),
    Bad("seed string", CHAT, chat(seed="abc"), param="seed"),
    Bad("seed huge", CHAT, chat(seed=2**70), param="seed"),
    Bad("logprobs string", CHAT, chat(logprobs="yes"), param="logprobs"),
    Bad("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=50), param="top_logprobs"),
    Bad("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), param="top_logprobs"),
    Bad("stream string", CHAT, chat(stream="yes"), param="stream"),
    Bad(
        "stream_options without stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        param="stream_options",
    ),
    Bad("min_tokens above max", CHAT, chat(min_tokens=5), param="min_tokens", says="min_tokens=5"),
    Bad("stop_token_ids negative", CHAT, chat(stop_token_ids=[-1]), param="stop_token_ids[0]"),
    Bad(
        "stop_token_ids outside vocab",
        CHAT,
        chat(stop_token_ids=[10**9]),
        says="outside the vocabulary",
    ),
    Bad(
        "tool name with a space",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        param="tools[0].function.name",
    ),
    Bad(
        "tool_choice naming a function not in tools",
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        param="tool_choice",
        says="'g'",
    ),
    Bad("tool_choice without tools", CHAT, chat(tool_choice="required"), param="tool_choice"),
    Bad("tool_choice unknown", CHAT, chat(tool_choice="sometimes"), param="tool_choice"),
    Bad(
        "tools and regex under tool_choice auto",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}], regex="[a-z]+"),
        param="regex",
    ),
    Bad(
        "tool result without its call id",
        CHAT,
        chat(messages=[{"role": "tool", "content": "42"}]),
        param="messages[0].tool_call_id",
    ),
    Bad(
        "chat_template_kwargs setting the messages",
        CHAT,
        chat(chat_template_kwargs={"messages": []}),
        param="chat_template_kwargs",
    ),
    Bad(
        "response_format type",
        CHAT,
        chat(response_format={"type": "xml"}),
        param="response_format.type",
        says="'xml'",
    ),
    Bad(
        "json_schema without a schema",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        param="response_format.json_schema.schema",
    ),
    Bad(
        "json_schema of an unknown type",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}),
        says='Unsupported type "objec"',
    ),
    Bad(
        "json_schema of a bad pattern",
        COMPLETIONS,
        completion(
            response_format={
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "pattern": "[a-"}},
            }
        ),
        says="invalid JSON schema",
    ),
    Bad("logit_bias key", CHAT, chat(logit_bias={"one": 5}), param="logit_bias", says="'one'"),
    Bad("logit_bias value", CHAT, chat(logit_bias={"1": 500}), param="logit_bias"),
    Bad(
        "logit_bias outside vocab",
        COMPLETIONS,
        completion(logit_bias={str(10**9): 1}),
        param="logit_bias",
        says="outside the vocabulary",
    ),
    # model
    Bad("unknown model", CHAT, chat(model="gpt-4o"), status=404, param="model", says="gpt-4o"),
    Bad("model not a string", COMPLETIONS, completion(model=123), param="model"),
    # completions prompt
    Bad("missing prompt", COMPLETIONS, {"max_tokens": 2}, param="prompt"),
    Bad("empty prompt", COMPLETIONS, completion(prompt=""), says="empty"),
    Bad("empty prompt list", COMPLETIONS, completion(prompt=[]), param="prompt"),
    Bad(
        "negative token id",
        COMPLETIONS,
        completion(prompt=[-1, 5]),
        param="prompt",
        says="non-negative",
    ),
    Bad(
        "token id outside vocab",
        COMPLETIONS,
        completion(prompt=[10**9]),
        says="outside the vocabulary",
    ),
    Bad(
        "batched prompts, too many",
        COMPLETIONS,
        completion(prompt=["a"] * 1025),
        param="prompt",
        says="batched",
    ),
    Bad(
        "batched token prompts, one empty",
        COMPLETIONS,
        completion(prompt=[[1, 2], []]),
        param="prompt",
    ),
    Bad("prompt object", COMPLETIONS, completion(prompt={"text": "hi"}), param="prompt"),
    Bad("prompt of mixed list", COMPLETIONS, completion(prompt=[1, "a"]), param="prompt"),
    Bad("completion logprobs too many", COMPLETIONS, completion(logprobs=21), param="logprobs"),
    Bad("max_tokens 0 without echo", COMPLETIONS, completion(max_tokens=0), param="max_tokens"),
    Bad("best_of", COMPLETIONS, completion(best_of=3), param="best_of"),
    Bad("suffix", COMPLETIONS, completion(suffix="end"), param="suffix"),
    # vLLM's constraint fields, ignored, would leave the output unconstrained
    Bad("guided_regex", CHAT, chat(guided_regex="[0-9]+"), param="guided_regex", says="regex"),
    Bad("guided_json", COMPLETIONS, completion(guided_json={}), param="guided_json", says="json"),
    Bad("guided_choice", CHAT, chat(guided_choice=["yes", "no"]), param="guided_choice"),
    Bad(
        "structured_outputs",
        COMPLETIONS,
        completion(structured_outputs={}),
        param="structured_outputs",
    ),
    Bad(
        "prompt too long by ids",
        COMPLETIONS,
        completion(prompt=[5] * (MAX_MODEL_LEN + 1)),
        says="max_model_len",
    ),
    # native /generate
    Bad("neither text nor ids", GENERATE, {"sampling_params": {}}, param="text"),
    Bad("both text and ids", GENERATE, {"text": "hi", "input_ids": [1]}, param="text"),
    Bad(
        "native max_new_tokens zero",
        GENERATE,
        native(max_new_tokens=0),
        param="sampling_params.max_new_tokens",
    ),
    Bad(
        "native temperature negative",
        GENERATE,
        native(temperature=-0.5),
        param="sampling_params.temperature",
    ),
    Bad(
        "native sampling_params list",
        GENERATE,
        {"text": "hi", "sampling_params": [{}]},
        param="sampling_params",
    ),
    Bad("native input_ids strings", GENERATE, {"input_ids": ["a"]}, param="input_ids"),
    Bad("native empty input_ids", GENERATE, {"input_ids": []}, param="input_ids"),
    Bad("native n", GENERATE, native(n=17), param="sampling_params.n", says="max_n"),
    Bad("native regex", GENERATE, native(regex="[a-"), says="invalid regular expression"),
    Bad("native ebnf", GENERATE, native(ebnf='root ::= "a" |'), says="invalid EBNF grammar"),
    Bad("native json_schema", GENERATE, native(json_schema="{not json"), says="not valid JSON"),
    Bad(
        "native two constraints",
        GENERATE,
        native(regex="a", ebnf='root ::= "a"'),
        param="sampling_params",
        says="one of",
    ),
    Bad("native batched text", GENERATE, {"text": ["a", "b"]}, param="text", says="batched"),
    Bad("native empty rid", GENERATE, {"text": "hi", "rid": ""}, param="rid"),
    Bad(
        "native stop_token_ids string",
        GENERATE,
        native(stop_token_ids="2"),
        param="sampling_params.stop_token_ids",
    ),
    Bad("native empty text", GENERATE, {"text": ""}, says="empty"),
    # HTTP level
    # invalid UTF-8 inside strings (bytes sent as they are)
    Bad(
        "raw 0xff in chat content",
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\xffb"}], "max_tokens": 2}',
        says="UTF-8",
    ),
    Bad(
        "raw 0xff in prompt",
        COMPLETIONS,
        b'{"prompt": "a\xff\xfeb", "max_tokens": 2}',
        says="UTF-8",
    ),
    Bad(
        "raw 0xff in native text",
        GENERATE,
        b'{"text": "\xff", "sampling_params": {}}',
        says="UTF-8",
    ),
    Bad("overlong utf-8 in prompt", COMPLETIONS, b'{"prompt": "a\xc0\xafb"}', says="UTF-8"),
    Bad(
        "truncated utf-8 in model",
        CHAT,
        b'{"model": "\xe2\x82", "messages": [{"role": "user", "content": "hi"}]}',
        says="UTF-8",
    ),
    Bad("lone surrogate escape", COMPLETIONS, b'{"prompt": "\\ud800"}', says="not valid JSON"),
    Bad(
        "raw 0xff in a stop string",
        GENERATE,
        b'{"text": "hi", "sampling_params": {"stop": "\xff"}}',
        says="UTF-8",
    ),
    # deep nesting, in known and unknown fields
    Bad(
        "messages nested 3000 deep",
        CHAT,
        b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        says="levels deep",
    ),
    Bad(
        "prompt nested 3000 deep",
        COMPLETIONS,
        b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        says="levels deep",
    ),
    Bad(
        "input_ids nested 3000 deep",
        GENERATE,
        b'{"input_ids": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        says="levels deep",
    ),
    Bad(
        "objects nested 3000 deep",
        GENERATE,
        b'{"text": "hi", "extra": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}",
        says="levels deep",
    ),
    Bad(
        "unknown field nested 40 deep",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 40 + b"]" * 40 + b"}",
        says="levels deep",
    ),
    Bad("never closed nesting", COMPLETIONS, b'{"prompt": ' + b"[" * 5000 + b"}"),
    # more tokens than the context holds, or than the configured limit
    Bad(
        "max_tokens 10**12",
        COMPLETIONS,
        completion(max_tokens=10**12),
        param="max_tokens",
        says="maximum context length is 512 tokens",
    ),
    Bad(
        "max_tokens 10**30",
        COMPLETIONS,
        completion(max_tokens=10**30),
        param="max_tokens",
        says=str(10**30),
    ),
    Bad(
        "chat max_tokens 10**12",
        CHAT,
        chat(max_tokens=10**12),
        param="max_tokens",
        says="lower max_tokens to at most",
    ),
    Bad(
        "max_completion_tokens 10**30",
        CHAT,
        chat(max_completion_tokens=10**30),
        param="max_completion_tokens",
        says="to generate",
    ),
    Bad(
        "native max_new_tokens 10**12",
        GENERATE,
        native(max_new_tokens=10**12),
        param="sampling_params.max_new_tokens",
        says="in the prompt",
    ),
    Bad(
        "max_tokens exactly the context",
        COMPLETIONS,
        completion(max_tokens=MAX_MODEL_LEN),
        param="max_tokens",
        says=f"at most {MAX_MODEL_LEN - 1}",
    ),
    Bad(
        "max_tokens above the server limit",
        CHAT,
        chat(max_tokens=MAX_NEW_TOKENS_LIMIT + 1),
        param="max_tokens",
        says="max_new_tokens_limit",
    ),
    Bad(
        "native above the server limit",
        GENERATE,
        native(max_new_tokens=MAX_NEW_TOKENS_LIMIT + 1),
        param="sampling_params.max_new_tokens",
        says="max_new_tokens_limit",
    ),
    # NaN, Infinity and numbers out of range
    Bad(
        "NaN temperature chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        says="not valid JSON",
    ),
    Bad(
        "Infinity top_p", COMPLETIONS, b'{"prompt": "hi", "top_p": Infinity}', says="not valid JSON"
    ),
    Bad(
        "-Infinity penalty",
        GENERATE,
        b'{"text": "hi", "sampling_params": {"presence_penalty": -Infinity}}',
        says="not valid JSON",
    ),
    Bad(
        "1e999 temperature",
        COMPLETIONS,
        b'{"prompt": "hi", "temperature": 1e999}',
        param="temperature",
        says="out of range",
    ),
    Bad(
        "1e999 max_tokens",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
        param="max_tokens",
    ),
    Bad(
        "native -1e999 top_p",
        GENERATE,
        b'{"text": "hi", "sampling_params": {"top_p": -1e999}}',
        param="sampling_params.top_p",
    ),
    Bad("seed as float", COMPLETIONS, completion(seed=1e30), param="seed"),
    Bad("n 10**30", COMPLETIONS, completion(n=10**30), param="n"),
    Bad(
        "stop_token_ids 2**64",
        GENERATE,
        native(stop_token_ids=[2**64]),
        says="outside the vocabulary",
    ),
    Bad("input_ids 10**30", GENERATE, {"input_ids": [10**30]}, says="outside the vocabulary"),
    Bad("min_tokens 10**12", CHAT, chat(min_tokens=10**12), param="min_tokens", says="min_tokens"),
    Bad(
        "native min_new_tokens above max", GENERATE, native(min_new_tokens=5), says="min_new_tokens"
    ),
    Bad(
        "top_logprobs_num 21",
        GENERATE,
        {"text": "hi", "return_logprob": True, "top_logprobs_num": 21},
        param="top_logprobs_num",
    ),
    Bad("completion logprobs 10**30", COMPLETIONS, completion(logprobs=10**30), param="logprobs"),
    # wrong types
    Bad(
        "messages an object",
        CHAT,
        chat(messages={"role": "user", "content": "hi"}),
        param="messages",
    ),
    Bad(
        "role a number",
        CHAT,
        chat(messages=[{"role": 1, "content": "hi"}]),
        param="messages[0].role",
    ),
    Bad(
        "content a list of strings",
        CHAT,
        chat(messages=[{"role": "user", "content": ["hi"]}]),
        param="messages[0].content[0]",
    ),
    Bad(
        "name a number",
        CHAT,
        chat(messages=[{"role": "user", "content": "hi", "name": 5}]),
        param="messages[0].name",
    ),
    Bad("stop list of numbers", COMPLETIONS, completion(stop=[1, 2]), param="stop[0]"),
    Bad("stop nested list", CHAT, chat(stop=[["a"]]), param="stop[0]"),
    Bad(
        "include_usage a string",
        CHAT,
        chat(stream=True, stream_options={"include_usage": "y"}),
        param="stream_options.include_usage",
    ),
    Bad("prompt null", COMPLETIONS, completion(prompt=None), param="prompt"),
    Bad("prompt true", COMPLETIONS, completion(prompt=True), param="prompt"),
    Bad("prompt of floats", COMPLETIONS, completion(prompt=[1.5, 2.5]), param="prompt"),
    Bad("native text a number", GENERATE, {"text": 5}, param="text"),
    Bad("native input_ids a string", GENERATE, {"input_ids": "1 2 3"}, param="input_ids"),
    Bad("native rid a number", GENERATE, {"text": "hi", "rid": 5}, param="rid"),
    Bad("native rid too long", GENERATE, {"text": "hi", "rid": "r" * 300}, param="rid"),
    Bad("native stream a string", GENERATE, {"text": "hi", "stream": "yes"}, param="stream"),
    Bad(
        "native return_logprob a string",
        GENERATE,
        {"text": "hi", "return_logprob": "yes"},
        param="return_logprob",
    ),
    Bad("native stop a number", GENERATE, native(stop=7), param="sampling_params.stop"),
    Bad(
        "native ignore_eos a string",
        GENERATE,
        native(ignore_eos="no"),
        param="sampling_params.ignore_eos",
    ),
    Bad(
        "native temperature a string",
        GENERATE,
        native(temperature="warm"),
        param="sampling_params.temperature",
    ),
    Bad("JSON null body", GENERATE, b"null", says="Expected `object`"),
    Bad("JSON number body", CHAT, 42, says="Expected `object`"),
    Bad("JSON true body", GENERATE, True, says="Expected `object`"),
    # 1000 stop strings: the message says how many, not what
    Bad(
        "1000 stop strings",
        COMPLETIONS,
        completion(stop=[f"stop{i}" for i in range(1000)]),
        says="stop=<a list of 1000 items>: at most 16 stop strings",
    ),
    Bad(
        "1000 native stop strings",
        GENERATE,
        native(stop=[f"stop{i}" for i in range(1000)]),
        says="a list of 1000 items",
    ),
    # empty and duplicate keys
    Bad("empty chat object", CHAT, {}, param="messages"),
    Bad("empty completions object", COMPLETIONS, {}, param="prompt"),
    Bad("empty native object", GENERATE, {}, param="text"),
    Bad("empty key only", COMPLETIONS, {"": "hi"}, param="prompt"),
    Bad(
        "duplicate key, bad last",
        COMPLETIONS,
        b'{"prompt": "hi", "max_tokens": 2, "max_tokens": -1}',
        param="max_tokens",
    ),
    Bad(
        "duplicate key, bad first",
        CHAT,
        b'{"messages": 5, "messages": [{"role": "user", "content": "hi"}]}',
        param="messages",
    ),
    Bad("duplicate native key", GENERATE, b'{"text": "hi", "text": 5}', param="text"),
    # content types
    Bad(
        "text/plain chat",
        CHAT,
        chat(),
        status=415,
        says="application/json",
        content_type="text/plain",
    ),
    Bad(
        "form-encoded completions",
        COMPLETIONS,
        completion(),
        status=415,
        says="curl",
        content_type="application/x-www-form-urlencoded",
    ),
    Bad(
        "multipart generate",
        GENERATE,
        native(),
        status=415,
        content_type="multipart/form-data; boundary=x",
    ),
    Bad(
        "json in latin-1",
        COMPLETIONS,
        completion(),
        status=415,
        says="UTF-8",
        content_type="application/json; charset=latin-1",
    ),
    Bad("xml chat", CHAT, chat(), status=415, content_type="application/xml"),
    # bodies that never end or never fit
    Bad(
        "chat chunked body never ends",
        CHAT,
        b'{"messages": [',
        status=408,
        says="did not arrive",
        transport="chunked-stall",
    ),
    Bad(
        "completions chunked body never ends",
        COMPLETIONS,
        b'{"pro',
        status=408,
        transport="chunked-stall",
    ),
    Bad("native chunked body never ends", GENERATE, b"{", status=408, transport="chunked-stall"),
    Bad("20 MB chat body", CHAT, b"x" * (20 << 20), status=413, transport="stream"),
    Bad("20 MB completions body", COMPLETIONS, b"x" * (20 << 20), status=413, transport="stream"),
    Bad("20 MB native body", GENERATE, b"x" * (20 << 20), status=413, transport="stream"),
    Bad("body too large", COMPLETIONS, completion(prompt="x" * (MAX_BODY_BYTES + 10)), status=413),
    Bad("GET on a POST route", COMPLETIONS, None, status=405, method="GET", says="allowed: POST"),
    Bad("unknown route", "/v1/rerank", {"query": "hi"}, status=404, says="/v1/rerank"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    config = engine_config(
        tiny_model_dir(tmp_path_factory), max_new_tokens_limit=MAX_NEW_TOKENS_LIMIT
    )
    running = await start_server(config, max_body_bytes=MAX_BODY_BYTES, body_timeout=BODY_TIMEOUT)
    yield running
    await running.stop()


def encoded(case: Bad) -> bytes | None:
    if case.body is None:
        return None
    if isinstance(case.body, bytes):
        return case.body
    return json.dumps(case.body).encode()


async def send(
    session: aiohttp.ClientSession, base_url: str, case: Bad
) -> tuple[int, dict[str, Any], dict]:
    if case.transport != "json":
        return await send_raw(base_url, case)
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    async with session.request(
        case.method, base_url + case.path, data=encoded(case), headers=headers
    ) as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def send_raw(base_url: str, case: Bad) -> tuple[int, dict[str, Any], dict]:
    """Write the request on a bare socket (a chunked body that stalls, or a body far above the
    limit written while the answer is read) and read the answer."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = encoded(case) or b""
    head = f"{case.method} {case.path} HTTP/1.1\r\nHost: {host}\r\n"
    head += f"Content-Type: {case.content_type}\r\n"
    if case.transport == "chunked-stall":
        head += "Transfer-Encoding: chunked\r\n\r\n"
        writer.write(head.encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n")
        feeding = None  # and then nothing more: no last chunk
    else:
        head += f"Content-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode())

        async def feed() -> None:
            with contextlib.suppress(ConnectionError):
                for start in range(0, len(body), 1 << 16):
                    writer.write(body[start : start + (1 << 16)])
                    await writer.drain()

        feeding = asyncio.create_task(feed())
    try:
        head_bytes = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        lines = head_bytes.decode().strip().split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(": ", 1) for line in lines[1:])
        payload = await asyncio.wait_for(reader.readexactly(int(headers["Content-Length"])), 30)
    finally:
        if feeding is not None:
            feeding.cancel()
        writer.close()
    return status, json.loads(payload), headers


async def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 100
    assert {case.path for case in CASES} >= {CHAT, COMPLETIONS, GENERATE}
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_bad_request(server: RunningServer, case: Bad) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        status, body, _ = await send(session, server.base_url, case)
    assert status == case.status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert case.says in error["message"], error
    if case.param is not None:
        assert error["param"] == case.param, error
    if 400 <= status < 500 and status not in (401, 404):
        assert error["type"] == "invalid_request_error"
    # and the server goes on serving
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(server.base_url + COMPLETIONS, json=completion()) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["usage"]["completion_tokens"] >= 1


async def test_server_is_healthy_after_the_bad_requests(server: RunningServer) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(server.base_url + "/health") as resp:
            assert resp.status == 200
        async with session.post(
            server.base_url + COMPLETIONS, json=completion(max_tokens=3)
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] >= 1
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)
    posted = [c for c in CASES if c.path == COMPLETIONS and c.method == "POST"]

    def counted(outcome: str) -> float:
        labels = {"endpoint": "completions", "outcome": outcome}
        return server.metrics.counter_value("asyncengine_requests_total", labels)

    # a 408 (a body that never finished) is counted as a timeout, every other 4xx as invalid
    assert counted("invalid") >= sum(1 for c in posted if c.status != 408)
    assert counted("timeout") >= sum(1 for c in posted if c.status == 408)


async def test_duplicate_rid_in_flight_is_refused(server: RunningServer) -> None:
    body = {
        "text": "hi",
        "rid": "twin",
        "stream": True,
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        first = await session.post(server.base_url + GENERATE, json=body)
        assert first.status == 200
        async with session.post(server.base_url + GENERATE, json=body) as second:
            assert second.status == 400
            assert "already in use" in (await second.json())["error"]["message"]
        first.close()
    assert await wait_until(lambda: engine_idle(server.engine))


async def test_a_rid_in_flight_is_refused_only_to_its_own_api_key(server: RunningServer) -> None:
    """Each API key names its rids apart: another key's request under the same rid is served
    (its meta_info.id the rid it sent), so a rid neither tells of nor blocks another key's."""
    keyed = await start_server(server.engine.config, engine=server.engine, api_key=["ka", "kb"])
    body = {
        "text": "hi",
        "rid": "twin",
        "stream": True,
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
    }
    url = keyed.base_url + GENERATE
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            first = await session.post(url, json=body, headers={"Authorization": "Bearer ka"})
            assert first.status == 200
            whole = {**body, "stream": False, "sampling_params": {"max_new_tokens": 2}}
            async with session.post(url, json=whole, headers={"x-api-key": "kb"}) as other:
                assert other.status == 200
                assert (await other.json())["meta_info"]["id"] == "twin"
            async with session.post(url, json=whole, headers={"x-api-key": "ka"}) as same:
                assert same.status == 400
                assert "already in use" in (await same.json())["error"]["message"]
            first.close()
        assert await wait_until(lambda: engine_idle(server.engine))
    finally:
        await keyed.stop(stop_engine=False)


async def test_full_queue_is_503_with_retry_after(tmp_path_factory: pytest.TempPathFactory) -> None:
    config = engine_config(
        tiny_model_dir(tmp_path_factory), max_running_requests=1, max_waiting_requests=1
    )
    small = await start_server(config)
    long_body = {"prompt": "hi", "stream": True, "max_tokens": 400, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            running = await session.post(small.base_url + COMPLETIONS, json=long_body)
            assert running.status == 200  # headers come with its first token: it is running
            waiting = asyncio.create_task(
                session.post(small.base_url + COMPLETIONS, json=long_body)
            )
            assert await wait_until(lambda: small.engine.stats()["waiting"] == 1)
            async with session.post(small.base_url + COMPLETIONS, json=long_body) as refused:
                assert refused.status == 503
                assert refused.headers["Retry-After"] == "1"
                error = (await refused.json())["error"]
                assert error["code"] == "queue_full"
                message = error["message"]
                assert "the most max_waiting_requests allows" in message  # the engine's reason
                assert message.count("retry") + message.count("try again") == 1  # said once
            running.close()
            (await waiting).close()
        assert await wait_until(lambda: engine_idle(small.engine))
        assert_no_leak(small.engine)
        assert (
            small.metrics.counter_value(
                "asyncengine_requests_total", {"endpoint": "completions", "outcome": "overloaded"}
            )
            == 1
        )
    finally:
        await small.stop()


async def test_a_refusal_logs_one_line_with_the_reason_and_no_prompt_text(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncengine.server")
    secret = "MY-PRIVATE-PROMPT-TEXT"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        body = completion(prompt=secret, max_tokens=10**9)
        async with session.post(server.base_url + COMPLETIONS, json=body) as resp:
            assert resp.status == 400
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in caplog.records]
    line = refused[0].getMessage()
    assert refused[0].levelno == logging.INFO
    assert "POST /v1/completions" in line and "400" in line and "context_length_exceeded" in line
    assert str(10**9) in line  # the reason, with its numbers
    assert all(secret not in r.getMessage() for r in caplog.records)


async def test_no_max_tokens_generates_up_to_the_limit(server: RunningServer) -> None:
    body = {"messages": USER, "ignore_eos": True}  # no max_tokens: up to the context...
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(server.base_url + CHAT, json=body) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
    # ... which max_new_tokens_limit caps
    assert out["usage"]["completion_tokens"] == MAX_NEW_TOKENS_LIMIT
    assert out["choices"][0]["finish_reason"] == "length"


async def test_text_that_encodes_past_the_models_vocabulary_is_a_400_beside_good_requests(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A tokenizer that knows more tokens than the model has embeddings (added tokens never
    resized into the model): text and chat that encode to such ids are refused at intake; in the
    forward they failed the whole step, the token-id request batched beside them included."""
    small = await start_server(engine_config(tiny_model_dir(tmp_path_factory, vocab_size=300)))
    good = {"prompt": list(range(5, 120)), "max_tokens": 4, "ignore_eos": True}
    bad = [
        (COMPLETIONS, completion(prompt="The quick brown fox")),
        (CHAT, chat(messages=[{"role": "user", "content": "The quick brown fox"}])),
        (GENERATE, native()),
    ]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
                async with session.post(small.base_url + path, json=body) as resp:
                    return resp.status, await resp.json(content_type=None)

            answers = await asyncio.gather(
                post(COMPLETIONS, good), *(post(path, body) for path, body in bad)
            )
        (status, out), refused = answers[0], answers[1:]
        assert status == 200 and out["usage"]["completion_tokens"] == 4, out
        for code, body in refused:
            assert code == 400, body
            assert "outside the model's vocabulary [0, 300)" in body["error"]["message"]
        assert await wait_until(lambda: engine_idle(small.engine))
        assert_no_leak(small.engine)
    finally:
        await small.stop()


# a template doing arithmetic on a chat_template_kwargs value
ARITHMETIC_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }} {{ 100 // scale }}"
    " {{ 10.0 ** scale }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _model_with_template(tmp_path_factory: pytest.TempPathFactory, template: str) -> Path:
    target = tmp_path_factory.mktemp("tiny_with_template")
    shutil.copytree(tiny_model_dir(tmp_path_factory), target, dirs_exist_ok=True)
    (target / "chat_template.jinja").write_text(template)
    return target


async def test_a_template_failing_on_a_kwarg_is_a_400_naming_its_error(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    small = await start_server(
        engine_config(_model_with_template(tmp_path_factory, ARITHMETIC_TEMPLATE))
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def post(scale: int) -> tuple[int, dict[str, Any]]:
                body = chat(chat_template_kwargs={"scale": scale})
                async with session.post(small.base_url + CHAT, json=body) as resp:
                    return resp.status, await resp.json(content_type=None)

            for scale, error in ((0, "ZeroDivisionError"), (400, "OverflowError")):
                status, out = await post(scale)
                assert status == 400, out
                assert out["error"]["type"] == "invalid_request_error"
                message = out["error"]["message"]
                assert f"the chat template failed on these messages: {error}" in message
            status, out = await post(2)
            assert status == 200 and out["usage"]["completion_tokens"] >= 1, out
        assert await wait_until(lambda: engine_idle(small.engine))
        assert_no_leak(small.engine)
    finally:
        await small.stop()
