"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the
``anthropic`` client over loopback, on the tiny random models: the same greedy text as Chat
Completions, streamed and whole, a two-round tool loop, stop sequences, thinking blocks,
Anthropic's error shape and its ``x-api-key``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.chat_models import tiny_thinking_qwen3_dir
from tests.openai_server import claude, client, server  # noqa: F401  (fixtures)
from tests.server_support import (
    RunningServer,
    assert_no_leak,
    engine_config,
    engine_idle,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"temperature": 0}  # the SDK's create() has no sampling arguments: sent as extra body
QUESTION = "What is the weather in Paris?"
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER_SCHEMA}]
UNCLOSED: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "string", "pattern": "(("}},
    "required": ["a"],
}


def _prompt_tokens(usage: anthropic.types.Usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def test_the_same_greedy_text_as_chat_completions_whole_and_streamed(
    claude: anthropic.AsyncAnthropic, client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    system = "You answer briefly."
    chat = await client.chat.completions.create(
        model=server.model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
    )
    kwargs: dict[str, Any] = dict(
        model=server.model,
        max_tokens=12,
        system=[{"type": "text", "text": system}],
        messages=_user(QUESTION),
        extra_body=GREEDY,
    )
    whole = await claude.messages.create(**kwargs)
    (block,) = whole.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.id.startswith("msg_") and whole.role == "assistant"
    assert chat.usage is not None
    usage = whole.usage
    assert usage.output_tokens == 12
    assert _prompt_tokens(usage) == chat.usage.prompt_tokens
    assert (usage.cache_read_input_tokens or 0) > 0  # the chat request left the prompt cached

    events = []
    async with claude.messages.stream(**kwargs) as stream:
        async for event in stream:
            events.append(event.type)
        final = await stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    wire = [e for e in events if e not in ("text", "thinking", "input_json")]  # SDK's own
    assert wire[:2] == ["message_start", "content_block_start"]
    assert wire[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert wire.count("content_block_delta") > 1

    counted = await claude.messages.count_tokens(
        model=server.model, system=system, messages=_user(QUESTION)
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


async def test_a_final_assistant_turn_is_continued_as_the_same_prompt_completed(
    claude: anthropic.AsyncAnthropic, client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """Anthropic's prefill and Chat Completions' continue_final_message: the prompt ends with
    the final message's text (no end of turn), and the reply is what follows it."""
    start = "The answer is"
    opened = server.engine.tokenizer.apply_chat_template(_user(QUESTION)) + start
    completion = await client.completions.create(
        model=server.model, prompt=opened, max_tokens=8, temperature=0
    )
    messages: list[Any] = [*_user(QUESTION), {"role": "assistant", "content": start}]
    chat = await client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage is not None and completion.usage is not None
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens
    message = await claude.messages.create(
        model=server.model, max_tokens=8, messages=messages, extra_body=GREEDY
    )
    (block,) = message.content
    assert block.type == "text" and block.text == completion.choices[0].text
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        await client.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )


async def test_a_stop_sequence_ends_the_message_and_is_named(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    kwargs: dict[str, Any] = dict(
        model=server.model, max_tokens=16, messages=_user("Tell me a story"), extra_body=GREEDY
    )
    text = (await claude.messages.create(**kwargs)).content[0].text  # type: ignore[union-attr]
    words = text.split()
    assert len(words) > 3
    stop = words[2]
    cut = await claude.messages.create(stop_sequences=[stop, "never-seen-xyz"], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


async def test_the_two_round_tool_loop_whole_and_streamed(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    messages: list[dict[str, Any]] = _user(QUESTION)
    kwargs: dict[str, Any] = dict(model=server.model, tools=TOOLS, extra_body=GREEDY)
    first = await claude.messages.create(
        max_tokens=80, messages=messages, tool_choice={"type": "any"}, **kwargs
    )
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert calls and all(c.name == "get_weather" and c.id.startswith("toolu_") for c in calls)
    for call in calls:
        jsonschema.validate(call.input, WEATHER_SCHEMA)  # the grammar made it valid

    async with claude.messages.stream(
        max_tokens=80, messages=messages, tool_choice={"type": "any"}, **kwargs
    ) as stream:
        partial: dict[int, list[str]] = {}  # by content block
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.setdefault(event.index, []).append(event.delta.partial_json)
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    streamed_calls = [b for b in streamed.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in streamed_calls] == [(c.name, c.input) for c in calls]
    for index, block in enumerate(streamed.content):
        if block.type == "tool_use":  # the input came in pieces that join to the whole
            assert len(partial[index]) > 1
            assert json.loads("".join(partial[index])) == block.input

    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    messages.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": '{"temperature": 21}'}
                for c in calls
            ],
        }
    )
    second = await claude.messages.create(
        max_tokens=8, messages=messages, tool_choice={"type": "none"}, **kwargs
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]
    # the call and its result went back through the template (tool_choice none: no tools)
    alone = await claude.messages.count_tokens(model=server.model, messages=_user(QUESTION))
    assert _prompt_tokens(second.usage) > alone.input_tokens + 20
    named = await claude.messages.create(
        max_tokens=80,
        messages=_user(QUESTION),
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        **kwargs,
    )
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]


async def _raw(
    server: RunningServer, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + path, json=body, headers=headers) as response:
            return response.status, await response.json()


async def test_refusals_have_anthropics_error_shape(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(
            model=server.model, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude.messages.create(model="no-such-model", max_tokens=4, messages=_user("hi"))
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]

    status, body = await _raw(server, "/v1/messages", {"messages": _user("hi")})
    assert status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]
    for bad in (
        {"messages": _user("hi"), "tool_choice": {"type": "any"}},  # no tools
        {"messages": _user("hi"), "tools": [{**TOOLS[0], "type": "web_search_20250305"}]},
        {"messages": _user("hi"), "temperature": 1.5},
    ):
        status, body = await _raw(server, "/v1/messages", {"max_tokens": 4, **bad})
        assert status == 400 and body["error"]["type"] == "invalid_request_error", bad
    # the fields are named as the Anthropic request names them, not as the chat request does
    unique = {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}
    for bad, named in (
        ({"stop_sequences": ["ok", ""]}, "stop_sequences[1]"),
        ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
        # a schema xgrammar cannot compile: Anthropic's shape has no param, the message names it
        ({"tools": [{"name": "f", "input_schema": UNCLOSED}]}, "tools[0].input_schema: "),
        # one of several held schemas: the compile error names it, not all the tools
        (
            {
                "tools": [*TOOLS, {"name": "f", "input_schema": UNCLOSED}],
                "tool_choice": {"type": "any"},
            },
            "tools[1].input_schema: ",
        ),
        ({"output_config": {"format": unique}}, "output_config.format.schema"),
    ):
        status, body = await _raw(
            server, "/v1/messages", {"max_tokens": 4, "messages": _user("hi"), **bad}
        )
        message = body["error"]["message"]
        assert status == 400 and named in message, message
        assert "function" not in message and "response_format" not in message, message
    status, body = await _raw(server, "/v1/messages/count_tokens", {"messages": []})
    assert status == 400 and body["type"] == "error"
    # the other APIs keep OpenAI's shape
    status, body = await _raw(server, "/v1/chat/completions", {"messages": []})
    assert status == 400 and set(body) == {"error"} and "param" in body["error"]


def _tool_use(*ids: str) -> dict[str, Any]:
    blocks = [{"type": "tool_use", "id": i, "name": "get_weather", "input": {}} for i in ids]
    return {"role": "assistant", "content": blocks}


def _tool_results(*ids: str) -> dict[str, Any]:
    results = [{"type": "tool_result", "tool_use_id": i, "content": "21"} for i in ids]
    return {"role": "user", "content": results}


async def test_a_tool_result_must_answer_a_tool_use_of_the_turn_before_it(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, max_tokens=1, tools=TOOLS)
    ask = _user(QUESTION)
    for messages in (
        [*ask, _tool_use("toolu_a", "toolu_b"), _tool_results("toolu_b", "toolu_a")],
        [*ask, _tool_use("toolu_a"), _tool_results("toolu_a")],
    ):
        assert (await claude.messages.create(messages=messages, **kwargs)).stop_reason
    for messages, index in (
        ([*ask, _tool_use("toolu_a"), {"role": "user", "content": [
            _tool_results("toolu_a")["content"][0], _tool_results("toolu_x")["content"][0]
        ]}], 2),
        ([*ask, _tool_use("toolu_x"), _tool_results("toolu_x"), _tool_results("toolu_x")], 3),
        ([_tool_results("toolu_x")], 0),
    ):  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(messages=messages, **kwargs)
        message = refused.value.body["error"]["message"]  # type: ignore[index]
        content = 1 if index == 2 else 0
        assert f"messages[{index}].content[{content}].tool_use_id 'toolu_x'" in message, message
    # and each call is answered in the next message, as the parallel calls of an agent are
    for messages, missing in (
        ([*ask, _tool_use("toolu_a", "toolu_b"), _tool_results("toolu_a")], "toolu_b"),
        ([*ask, _tool_use("toolu_a", "toolu_b"), *_user("stop")], "toolu_a, toolu_b"),
        ([*ask, _tool_use("toolu_b"), _tool_results("toolu_a")], "toolu_b"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(messages=messages, **kwargs)
        with pytest.raises(anthropic.BadRequestError) as counted:
            await claude.messages.count_tokens(model=server.model, messages=messages, tools=TOOLS)
        for error in (refused, counted):
            message = error.value.body["error"]["message"]  # type: ignore[index]
            assert message.startswith("messages[1] has tool_use ids that messages[2] answers")
            assert f"with no tool_result block: {missing};" in message, message


async def _refused_by_both(
    claude: anthropic.AsyncAnthropic, server: RunningServer, **kwargs: Any
) -> list[str]:
    """The messages of the 400s ``messages.create`` and ``messages.count_tokens`` answer."""
    messages = []
    for send in (claude.messages.create, claude.messages.count_tokens):
        sent: dict[str, Any] = dict(model=server.model, **kwargs)
        if send == claude.messages.create:
            sent["max_tokens"] = 1
        with pytest.raises(anthropic.BadRequestError) as refused:
            await send(**sent)
        body = refused.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
        messages.append(body["error"]["message"])
    return messages


async def test_tool_use_and_tool_result_blocks_need_tools(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """As Anthropic's API: a conversation with calls and results defines its tools (their
    schemas are what the calls were made against), or it is a 400."""
    answered = [*_user(QUESTION), _tool_use("toolu_a"), _tool_results("toolu_a")]
    for extra in ({}, {"tools": []}, {"tool_choice": {"type": "none"}}):
        for message in await _refused_by_both(claude, server, messages=answered, **extra):
            assert message == (
                "messages[1].content[0]: Requests which include `tool_use` or `tool_result` "
                "blocks must define tools."
            )
    given = await claude.messages.create(
        model=server.model, max_tokens=1, messages=answered, tools=TOOLS
    )
    assert given.stop_reason


async def test_a_tool_use_id_used_twice_is_refused_as_ambiguous(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """As Anthropic's API: ids are unique across the request, else a result could answer
    either call."""
    ask = _user(QUESTION)
    for messages, where, first in (
        ([*ask, _tool_use("toolu_a", "toolu_a"), _tool_results("toolu_a")], 1, "[1].content[0]"),
        (
            [*ask, _tool_use("toolu_a"), _tool_results("toolu_a"), _tool_use("toolu_a"),
             _tool_results("toolu_a")],
            3,
            "[1].content[0]",
        ),
    ):  # fmt: skip
        for message in await _refused_by_both(claude, server, messages=messages, tools=TOOLS):
            assert message.startswith(f"messages[{where}].content[")
            assert "tool_use ids must be unique" in message and f"messages{first}" in message


async def test_empty_or_blank_text_and_a_prefill_ending_in_whitespace_are_refused(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """Anthropic's rules: every message but a final assistant one has content, no text block
    is empty or blank, and a prefill does not end with whitespace; the 400 names the message.
    Anthropic's error bodies carry the ``request-id`` header's id as ``request_id``."""
    ask = _user(QUESTION)
    refusals: list[tuple[list[Any], str, str]] = [
        (_user(""), "messages[0].content", "all messages must have non-empty content"),
        ([{"role": "user", "content": []}], "messages[0].content", "non-empty content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "Hi"}, _text("")]}],
            "messages[0].content[1].text",
            "text content blocks must be non-empty",
        ),
        (
            [*ask, {"role": "assistant", "content": ""}, *_user("Again?")],
            "messages[1].content",
            "non-empty content",
        ),
        (_user(" \n"), "messages[0].content", "must contain non-whitespace text"),
        (
            [*ask, {"role": "assistant", "content": [_text("")]}],
            "messages[1].content[0].text",
            "text content blocks must be non-empty",
        ),
        (
            [*ask, {"role": "assistant", "content": "The answer is "}],
            "messages[1].content",
            "final assistant content cannot end with trailing whitespace",
        ),
        (
            [*ask, {"role": "assistant", "content": [_text("The answer\n")]}],
            "messages[1].content",
            "cannot end with trailing whitespace",
        ),
    ]
    for messages, param, reason in refusals:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(model=server.model, max_tokens=1, messages=messages)
        with pytest.raises(anthropic.BadRequestError) as counted:
            await claude.messages.count_tokens(model=server.model, messages=messages)
        for error in (refused, counted):
            message = error.value.body["error"]["message"]  # type: ignore[index]
            assert message.startswith(param) and reason in message, message
            assert error.value.body["request_id"] == error.value.request_id  # type: ignore[index]
    prefill = [*ask, {"role": "assistant", "content": [_text("The answer"), _text(" is")]}]
    answer = await claude.messages.create(model=server.model, max_tokens=1, messages=prefill)
    assert answer.stop_reason == "max_tokens"


async def test_an_empty_final_assistant_turn_is_as_if_absent(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """Anthropic lets the final assistant message be empty: no prefill, the same reply (and
    prompt) as without it."""
    ask = _user(QUESTION)
    plain = await claude.messages.create(
        model=server.model, max_tokens=6, messages=ask, extra_body=GREEDY
    )
    counted = await claude.messages.count_tokens(model=server.model, messages=ask)
    for last in ("", []):
        messages = [*ask, {"role": "assistant", "content": last}]
        answer = await claude.messages.create(
            model=server.model, max_tokens=6, messages=messages, extra_body=GREEDY
        )
        assert answer.content == plain.content and answer.usage == plain.usage
        assert await claude.messages.count_tokens(model=server.model, messages=messages) == counted


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


async def test_server_and_typed_tools_are_refused_as_not_served(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """They have no input_schema: the refusal says what they are, not that a field is
    missing; the same for count_tokens."""
    typed_tools: list[Any] = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250124", "name": "str_replace_editor"},
    ]
    for typed in typed_tools:
        for call in (claude.messages.create, claude.messages.count_tokens):
            kwargs = {"max_tokens": 4} if call == claude.messages.create else {}
            with pytest.raises(anthropic.BadRequestError) as refused:
                await call(
                    model=server.model, messages=_user("hi"), tools=[TOOLS[0], typed], **kwargs
                )
            message = refused.value.body["error"]["message"]  # type: ignore[index]
            assert "tools[1] has type" in message and "not served" in message, message
            assert "input_schema" not in message.split("only")[0], message
    status, body = await _raw(
        server, "/v1/messages", {"max_tokens": 4, "messages": _user("hi"), "tools": [{"name": "f"}]}
    )
    assert status == 400 and "tools[0].input_schema is missing" in body["error"]["message"]


async def test_a_strict_tool_schema_the_grammar_cannot_hold_is_refused(
    server: RunningServer,
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    tool = {"name": "f", "input_schema": schema}
    for extra, refused in (({"strict": True}, True), ({}, False)):
        body = {"max_tokens": 4, "messages": _user("hi"), "tools": [{**tool, **extra}]}
        status, answer = await _raw(server, "/v1/messages", body)
        if refused:
            message = answer["error"]["message"]
            assert status == 400 and "tools[0].input_schema" in message, answer
            assert "'not' at #/properties/n" in message
        else:  # a tool that is not strict, under auto: its schema describes it
            assert status == 200, answer


async def test_an_output_format_is_structured_output_under_either_name(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """``output_config.format``, and ``output_format`` as the structured-outputs beta sent it."""
    fmt = {"type": "json_schema", "schema": WEATHER_SCHEMA}
    kwargs: dict[str, Any] = dict(model=server.model, max_tokens=40, messages=_user(QUESTION))
    for body in ({"output_config": {"format": fmt}}, {"output_format": fmt}):
        message = await claude.messages.create(**kwargs, extra_body={**GREEDY, **body})
        (block,) = message.content
        assert message.stop_reason == "end_turn" and block.type == "text", message
        jsonschema.validate(json.loads(block.text), WEATHER_SCHEMA)
    with pytest.raises(anthropic.BadRequestError) as refused:
        both = {"output_config": {"format": fmt}, "output_format": fmt}
        await claude.messages.create(**kwargs, extra_body=both)
    assert "not both" in refused.value.body["error"]["message"]  # type: ignore[index]


async def test_server_side_features_are_refused_as_not_served(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """MCP servers and code-execution containers would change what the model may do; ignored,
    the agent would run without them unawares. Context management, which Claude Code sends on
    every request, is served as a conversation read as sent."""
    mcp = [{"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}]
    for param, value in (("mcp_servers", mcp), ("container", "container_1")):
        for call in (claude.beta.messages.create, claude.beta.messages.count_tokens):
            kwargs: dict[str, Any] = (
                {"max_tokens": 4} if call == claude.beta.messages.create else {}
            )
            with pytest.raises(anthropic.BadRequestError) as refused:
                await call(
                    model=server.model, messages=_user("hi"), extra_body={param: value}, **kwargs
                )
            message = refused.value.body["error"]["message"]  # type: ignore[index]
            assert message.startswith(f"{param}: ") and "not" in message, message
    edits: Any = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    message = await claude.beta.messages.create(
        model=server.model, max_tokens=2, messages=_user("hi"), context_management=edits
    )
    assert message.stop_reason == "max_tokens"


async def test_an_unknown_field_is_refused_by_name_and_platform_fields_are_accepted(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """As in Anthropic's API, a field the API does not know is a 400 naming it: ignored, a
    misspelt ``max_token`` or another API's ``ignore_eos`` would be lost unawares."""
    for extra in ({"max_token": 4}, {"ignore_eos": True}, {"metadata_": {}}):
        (name,) = extra
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(
                model=server.model, max_tokens=2, messages=_user("hi"), extra_body=extra
            )
        error = refused.value.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error" and f"`{name}`" in error["message"]
    with pytest.raises(anthropic.BadRequestError) as refused:  # not a field of count_tokens
        await claude.messages.count_tokens(
            model=server.model, messages=_user("hi"), extra_body={"max_tokens": 4}
        )
    assert "`max_tokens`" in refused.value.body["error"]["message"]  # type: ignore[index]
    # Anthropic's platform fields, and cache_control on a block, are accepted
    tools: Any = [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}]
    message = await claude.messages.create(
        model=server.model,
        max_tokens=2,
        messages=_user("hi"),
        tools=tools,
        cache_control={"type": "ephemeral"},
        service_tier="auto",
        inference_geo="us",
        speed="standard",
    )
    assert message.stop_reason in ("max_tokens", "tool_use", "end_turn")
    counted = await claude.messages.count_tokens(
        model=server.model,
        messages=_user("hi"),
        cache_control={"type": "ephemeral"},
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
    )
    assert counted.input_tokens > 0


async def test_the_models_list_has_anthropics_fields(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    page = await claude.models.list()
    (model,) = page.data
    assert (model.id, model.type, model.display_name) == (server.model, "model", server.model)
    assert model.created_at.year == 1970  # OpenAI's `created` (0) as Anthropic dates it
    assert (page.first_id, page.last_id, page.has_more) == (server.model, server.model, False)
    one = await claude.models.retrieve(server.model)
    assert (one.id, one.type, one.display_name) == (server.model, "model", server.model)


async def test_the_api_key_comes_as_x_api_key_or_bearer(server: RunningServer) -> None:
    guarded = await start_server(server.engine.config, engine=server.engine, api_key="s3cret")
    try:
        request: dict[str, Any] = dict(model=guarded.model, max_tokens=2, messages=_user("hi"))
        async with anthropic.AsyncAnthropic(
            base_url=guarded.base_url, api_key="s3cret", max_retries=0
        ) as keyed:
            assert (await keyed.messages.create(**request)).usage.output_tokens == 2
        async with anthropic.AsyncAnthropic(
            base_url=guarded.base_url, auth_token="s3cret", max_retries=0
        ) as bearer:
            assert (await bearer.messages.create(**request)).usage.output_tokens == 2
        async with anthropic.AsyncAnthropic(
            base_url=guarded.base_url, api_key="wrong", max_retries=0
        ) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await wrong.messages.create(**request)
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        async with aiohttp.ClientSession() as session:  # x-api-key opens the other routes too
            for key, status in (("s3cret", 200), ("wrong", 401)):
                async with session.get(
                    guarded.base_url + "/v1/models", headers={"x-api-key": key}
                ) as response:
                    assert response.status == status
    finally:
        await guarded.stop(stop_engine=False)


async def test_a_streamed_message_splits_a_cached_prompt_as_the_whole_one(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    kwargs: dict[str, Any] = dict(
        model=server.model,
        max_tokens=4,
        system="You answer in one word. " * 4,  # several pages: a repeat reads most from cache
        messages=_user("Name a colour."),
        extra_body=GREEDY,
    )
    await claude.messages.create(**kwargs)  # the later two find the prompt cached
    async with claude.messages.stream(**kwargs) as stream:
        events = [e async for e in stream]
    whole = (await claude.messages.create(**kwargs)).usage
    (start,) = [e.message.usage for e in events if e.type == "message_start"]
    (end,) = [e.usage for e in events if e.type == "message_delta"]
    assert (whole.cache_read_input_tokens or 0) >= 16
    for usage in (start, end):
        assert usage.input_tokens == whole.input_tokens
        assert usage.cache_read_input_tokens == whole.cache_read_input_tokens


async def test_nothing_leaks_after_the_messages(server: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def thinker(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    running = await start_server(engine_config(tiny_thinking_qwen3_dir(tmp_path_factory)))
    yield running
    await running.stop()


async def test_reasoning_comes_as_thinking_blocks_whole_and_streamed(
    thinker: RunningServer,
) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=thinker.base_url, api_key="unused", max_retries=0
    ) as c:
        kwargs: dict[str, Any] = dict(
            model=thinker.model, max_tokens=10, messages=_user(QUESTION), extra_body=GREEDY
        )
        whole = await c.messages.create(thinking={"type": "adaptive"}, **kwargs)
        (block,) = whole.content
        assert block.type == "thinking" and block.thinking.strip()
        assert "<think>" not in block.thinking
        async with c.messages.stream(thinking={"type": "adaptive"}, **kwargs) as stream:
            deltas = [
                e.delta.type  # type: ignore[union-attr]
                async for e in stream
                if e.type == "content_block_delta"
            ]
            streamed = await stream.get_final_message()
        assert set(deltas) == {"thinking_delta"} and len(deltas) > 1
        assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
        # disabled: the template closes the think block in the prompt, the output is the answer
        plain = await c.messages.create(thinking={"type": "disabled"}, **kwargs)
        assert [b.type for b in plain.content] == ["text"]
        assert _prompt_tokens(plain.usage) > _prompt_tokens(whole.usage)  # the closed block
        # earlier thinking blocks are dropped, as the template drops earlier reasoning
        history = [
            *_user(QUESTION),
            {"role": "assistant", "content": [block.model_dump(), {"type": "text", "text": "Hi"}]},
            *_user("And Oslo?"),
        ]
        without = [*_user(QUESTION), {"role": "assistant", "content": "Hi"}, *_user("And Oslo?")]
        counts = [
            (await c.messages.count_tokens(model=thinker.model, messages=m)).input_tokens
            for m in (history, without)
        ]
        assert counts[0] == counts[1]
    assert await wait_until(lambda: engine_idle(thinker.engine))
    assert_no_leak(thinker.engine)
