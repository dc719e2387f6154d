"""Tool calls and reasoning through the openai client, on tiny random models: the embedded
model's ChatML template (no tool format: the fallback prompt) and a tiny Qwen3 whose template
renders tools and think blocks. Constrained decoding makes even a random model's calls valid."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.chat_models import tiny_qwen3_dir
from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import (
    RunningServer,
    assert_no_leak,
    engine_config,
    engine_idle,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def run_tool(name: str, arguments: str) -> str:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])  # the grammar made the call valid
    return json.dumps({"city": args.get("city"), "temperature": 21})


async def test_the_tool_loop_with_required_then_auto(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    messages: list[Any] = list(QUESTION)
    first = await client.chat.completions.create(
        model=server.model,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(call.type == "function" and call.id.startswith("call_") for call in calls)
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in calls:
        result = run_tool(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = await client.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.usage is not None and first.usage is not None
    # the calls and their results went back through the template
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20
    reply = answer.choices[0]
    assert reply.finish_reason in {"stop", "length", "tool_calls"}
    if reply.finish_reason == "tool_calls":
        for call in reply.message.tool_calls or []:
            run_tool(call.function.name, call.function.arguments)
    else:
        assert reply.message.content and reply.message.tool_calls is None


async def test_a_named_function_streams_id_and_name_then_arguments(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs: dict[str, Any] = dict(
        model=server.model, messages=QUESTION, tools=TOOLS, tool_choice=named, temperature=0
    )
    whole = await client.chat.completions.create(max_tokens=60, **kwargs)
    stream = await client.chat.completions.create(max_tokens=60, stream=True, **kwargs)
    pieces = []
    finish_reasons = []
    async for chunk in stream:
        for choice in chunk.choices:
            in_chunk = choice.delta.tool_calls or []
            assert len({p.index for p in in_chunk}) == len(in_chunk)  # one entry per call
            pieces += in_chunk
            assert not choice.delta.content
            finish_reasons.append(choice.finish_reason)
    assert finish_reasons[-1] == "tool_calls"
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name == "get_time"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2  # the arguments came in several chunks
    arguments = "".join(p.function.arguments or "" for p in pieces)
    run_tool("get_time", arguments)
    (call,) = whole.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_time", arguments)


async def test_a_stop_string_never_cuts_a_forced_call(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """Every call's JSON holds '"': with tool_choice required (or named) the output is calls
    alone, whole by their grammar, and a stop string (text's) cuts none of them."""
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(
            model=server.model,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            stop=['"', "time"],
            max_tokens=120,
            temperature=0,
        )
        if not stream:
            whole = await client.chat.completions.create(**kwargs)
            choice = whole.choices[0]
            finish, calls = choice.finish_reason, choice.message.tool_calls or []
            pairs = [(c.function.name, c.function.arguments) for c in calls]
        else:
            pieces, finish = [], None
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                for delta_choice in chunk.choices:
                    pieces += delta_choice.delta.tool_calls or []
                    finish = delta_choice.finish_reason or finish
            arguments = "".join(p.function.arguments or "" for p in pieces)
            pairs = [(pieces[0].function.name, arguments)]
        assert finish == "tool_calls", (stream, pairs)
        for name, arguments in pairs:
            run_tool(name, arguments)  # valid JSON that the function's schema takes


FUNCTIONS = [tool["function"] for tool in TOOLS]


async def test_a_response_format_beside_forced_calls_is_served(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    # OpenAI's API takes both; under a forced call the output is calls, no text to format
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        response = await client.chat.completions.create(
            model=server.model,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            response_format=fmt,
            max_tokens=80,
            temperature=0,
        )
        (call,) = response.choices[0].message.tool_calls or []
        assert response.choices[0].finish_reason == "tool_calls"
        run_tool(call.function.name, call.function.arguments)


async def test_legacy_functions_call_as_function_call_whole_and_streamed(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """OpenAI's legacy ``functions`` / ``function_call``: one call, in ``message.function_call``
    with finish_reason "function_call" (streamed: ``delta.function_call``, its name first), and
    the result sent back as a "function" message."""
    kwargs: dict[str, Any] = dict(
        model=server.model,
        messages=QUESTION,
        functions=FUNCTIONS,
        function_call={"name": "get_weather"},
        max_tokens=120,
        temperature=0,
    )
    whole = await client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "function_call"
    call = choice.message.function_call
    assert call is not None and call.name == "get_weather" and not choice.message.tool_calls
    run_tool(call.name, call.arguments)
    pieces, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for delta_choice in chunk.choices:
            assert not delta_choice.delta.tool_calls
            if delta_choice.delta.function_call is not None:
                pieces.append(delta_choice.delta.function_call)
            finish = delta_choice.finish_reason or finish
    assert finish == "function_call" and pieces[0].name == "get_weather"
    assert all(piece.name is None for piece in pieces[1:])
    assert "".join(piece.arguments or "" for piece in pieces) == call.arguments
    result = {"role": "function", "name": call.name, "content": run_tool(call.name, call.arguments)}
    messages = [*QUESTION, choice.message.model_dump(exclude_none=True), result]
    answer = await client.chat.completions.create(
        model=server.model, messages=messages, functions=FUNCTIONS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "function_call")


async def test_legacy_functions_refusals(client: openai.AsyncOpenAI, server: RunningServer) -> None:
    for extra, param in (
        ({"functions": FUNCTIONS, "tools": TOOLS}, "functions"),
        ({"function_call": {"name": "get_weather"}}, "function_call"),
        ({"messages": [*QUESTION, {"role": "function", "name": "f", "content": "1"}]}, None),
    ):
        kwargs: dict[str, Any] = {"model": server.model, "messages": QUESTION, "max_tokens": 4}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(**{**kwargs, **extra})
        error = caught.value.body
        assert isinstance(error, dict)
        if param is not None:
            assert error["param"] == param, error
        else:
            assert "no assistant function_call before it" in error["message"], error


def _called(*ids: str) -> dict[str, Any]:
    calls = [
        {"id": i, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        for i in ids
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "12:00"}


async def test_a_tool_result_must_answer_a_call_of_the_assistant_message_before_it(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """As OpenAI's API: refused when the id names no call of the assistant message just before
    (tool messages between); answered in any order, or after trimmed turns, it is served."""
    served = [
        [*QUESTION, _called("call_a", "call_b"), _result("call_b"), _result("call_a")],
        [_called("call_a"), _result("call_a"), *QUESTION],  # the turns before it trimmed
        [*QUESTION, _called("call_a"), _result("call_a"), _called("call_b"), _result("call_b")],
    ]
    for messages in served:
        out = await client.chat.completions.create(
            model=server.model, messages=messages, tools=TOOLS, max_tokens=1
        )
        assert out.choices[0].finish_reason == "length"
    refused = [
        ([*QUESTION, _called("call_a"), _result("call_x")], 2, "call_x"),
        ([*QUESTION, _called("call_a"), _result("call_a"), _result("call_a2")], 3, "call_a2"),
        ([_result("call_a"), *QUESTION], 0, "call_a"),  # the call it answers trimmed away
        ([*QUESTION, _called("call_a"), *QUESTION, _result("call_a")], 3, "call_a"),
        (
            [_called("call_a"), _result("call_a"), *QUESTION, _called("c"), _result("call_a")],
            4,
            "call_a",
        ),
    ]
    for messages, index, call_id in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=server.model, messages=messages, tools=TOOLS, max_tokens=1
            )
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == f"messages[{index}].tool_call_id"
        assert repr(call_id) in error["message"], error


async def test_tool_choice_none_and_no_tools_leave_the_output_text(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    plain = await client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=6, temperature=0
    )
    none = await client.chat.completions.create(
        model=server.model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=6,
        temperature=0,
    )
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    assert none.usage is not None and plain.usage is not None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # tools not rendered


def _tagging_tool(strict: bool | None) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "not": {}}},
    }
    function: dict[str, Any] = {"name": "tag", "parameters": schema}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


async def test_a_held_tool_schema_with_a_keyword_the_grammar_drops_is_a_400(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """Strict tools, "required" and a named choice hold the arguments to the schema: one the
    grammar cannot hold is refused. Under "auto" a tool that is not strict is described by
    its schema, and served."""
    named = {"type": "function", "function": {"name": "tag"}}
    for strict, choice in ((True, "auto"), (None, "required"), (None, named)):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=server.model,
                messages=QUESTION,
                tools=[TOOLS[1], _tagging_tool(strict)],
                tool_choice=choice,  # type: ignore[arg-type]
                max_tokens=5,
            )
        error = caught.value.body
        assert isinstance(error, dict)
        assert "'not' at #/properties/tags" in error["message"], error
        assert error["param"] == "tools[1].function.parameters"
    for strict, choice in ((None, "auto"), (False, "required")):
        out = await client.chat.completions.create(
            model=server.model,
            messages=QUESTION,
            tools=[TOOLS[1], _tagging_tool(strict)],
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=5,
        )
        assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


async def test_a_tool_pattern_the_grammar_cannot_read_is_named_or_left_out(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """xgrammar fails the compile of a pattern with ``\\p{L}`` (or a lookbehind, ``\\b``,
    ...): a held tool is refused naming it; under "auto" a tool only described is served, its
    call held to the rest of its schema, rather than every request of the agent failing."""
    words = {"type": "string", "pattern": "^\\p{L}+$"}
    schema = {"type": "object", "properties": {"word": words}, "required": ["word"]}
    tool: Any = {"type": "function", "function": {"name": "spell", "parameters": schema}}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=server.model,
            messages=QUESTION,
            tools=[TOOLS[1], tool],
            tool_choice="required",
            max_tokens=5,
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "tools[1].function.parameters"
    assert "'pattern' at #/properties/word" in error["message"], error
    assert "cannot read a Unicode property class" in error["message"], error
    out = await client.chat.completions.create(
        model=server.model, messages=QUESTION, tools=[TOOLS[1], tool], max_tokens=5
    )
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


async def test_nothing_leaks_after_the_tool_requests(server: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen3(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    running = await start_server(engine_config(tiny_qwen3_dir(tmp_path_factory)))
    yield running
    await running.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen3_client(qwen3: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=qwen3.base_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


async def test_the_template_renders_the_tools_as_the_client_wrote_them(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    """Fields a tool leaves out stay out of the prompt: its tokens are HF's rendering's."""
    out = await qwen3_client.chat.completions.create(
        model=qwen3.model, messages=QUESTION, tools=TOOLS, max_tokens=1, temperature=0
    )
    tokenizer = qwen3.engine.tokenizer
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tools=TOOLS)
    assert "strict" not in rendered and "get_time" in rendered
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered))


def _token(server: RunningServer, text: str) -> int:
    (token,) = server.engine.tokenizer.encode(text)
    return int(token)


async def test_auto_lets_the_model_call_and_the_grammar_completes_the_call(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    # The bias makes the random model open a call; the grammar then writes a valid one.
    bias = {str(_token(qwen3, "<tool_call>")): 100}
    for stream in (False, True):
        response = await qwen3_client.chat.completions.create(
            model=qwen3.model,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="auto",
            parallel_tool_calls=False,
            logit_bias=bias,
            max_tokens=80,
            temperature=0,
            stream=stream,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        if stream:
            pieces, reasons = [], []
            async for chunk in response:
                for choice in chunk.choices:
                    pieces += choice.delta.tool_calls or []
                    reasons.append(choice.finish_reason)
            name = pieces[0].function.name
            arguments = "".join(p.function.arguments or "" for p in pieces)
            assert reasons[-1] == "tool_calls"
        else:
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls or []
            name, arguments = call.function.name, call.function.arguments
        run_tool(name, arguments)


async def test_a_call_cut_before_its_name_is_neither_a_call_nor_text(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    """Under "auto" the call marker starts a call the grammar holds: cut before its name, its
    markup is not the answer, whole or streamed."""
    kwargs: dict[str, Any] = dict(
        model=qwen3.model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="auto",
        logit_bias={str(_token(qwen3, "<tool_call>")): 100},
        max_tokens=3,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    whole = (await qwen3_client.chat.completions.create(**kwargs)).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content == "" and whole.message.tool_calls is None
    stream = await qwen3_client.chat.completions.create(stream=True, **kwargs)
    content, reasons = "", []
    async for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    assert (content, reasons[-1]) == ("", "length")


async def test_auto_with_a_response_format_answers_its_json_or_calls(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    """Agent frameworks send tools and an output schema together under "auto" (the Agents
    SDK's tools with an output_type): the answer is JSON valid under the schema, or calls."""
    answer = TIME_SCHEMA  # bounded: a random model's answer ends
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}
    marker = str(_token(qwen3, "<tool_call>"))
    kwargs: dict[str, Any] = dict(
        model=qwen3.model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        response_format=fmt,
        max_tokens=80,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    called = await qwen3_client.chat.completions.create(logit_bias={marker: 100}, **kwargs)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    run_tool(call.function.name, call.function.arguments)
    text = await qwen3_client.chat.completions.create(logit_bias={marker: -100}, **kwargs)
    choice = text.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.content or ""), answer)


async def test_the_call_end_marker_inside_a_string_argument_is_the_arguments_text(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    """A string value may hold ``</tool_call>`` (the grammar allows it, and a weak model
    writes it): it is the argument's text, not the call's end, whole and streamed."""
    note = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    close = "</tool_call>"
    kwargs: dict[str, Any] = dict(
        model=qwen3.model,
        messages=QUESTION,
        tools=[{"type": "function", "function": {"name": "take_note", "parameters": note}}],
        tool_choice={"type": "function", "function": {"name": "take_note"}},
        logit_bias={str(_token(qwen3, close)): 100},
        max_tokens=40,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    whole = (await qwen3_client.chat.completions.create(**kwargs)).choices[0]
    assert whole.finish_reason == "length"  # the string never closes: a cut call
    (call,) = whole.message.tool_calls or []
    value = call.function.arguments.partition('"note":')[2].lstrip()
    assert value.startswith('"' + close + close), call.function.arguments
    stream = await qwen3_client.chat.completions.create(stream=True, **kwargs)
    pieces = [
        piece
        async for chunk in stream
        for choice in chunk.choices
        for piece in choice.delta.tool_calls or []
    ]
    assert {piece.index for piece in pieces} == {0}
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


THINK_THEN_ANSWER = r"<think>[a-z]{2,6}( [a-z]{2,6}){2,4}</think>\n\n[a-z]{2,6}( [a-z]{2,6}){2,4}"


async def test_reasoning_is_split_from_the_answer_whole_and_streamed(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    # The regex stands in for a trained model that thinks before it answers.
    kwargs: dict[str, Any] = dict(
        model=qwen3.model,
        messages=QUESTION,
        max_tokens=60,
        temperature=0,
        extra_body={"regex": THINK_THEN_ANSWER},
    )
    whole = await qwen3_client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and "think>" not in message.content
    assert " " in reasoning and " " in message.content
    stream = await qwen3_client.chat.completions.create(stream=True, **kwargs)
    order, streamed = [], {"reasoning_content": "", "content": ""}
    async for chunk in stream:
        for choice in chunk.choices:
            for key in streamed:
                value = (choice.delta.model_extra or {}).get(key) or getattr(
                    choice.delta, key, None
                )
                if value:
                    streamed[key] += value
                    order.append(key)
    assert streamed == {"reasoning_content": reasoning, "content": message.content}
    assert order.index("content") > len(order) - order[::-1].index("reasoning_content") - 1
    assert order.count("reasoning_content") > 1 and order.count("content") > 1


async def test_include_reasoning_false_leaves_the_reasoning_out_whole_and_streamed(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    kwargs: dict[str, Any] = dict(
        model=qwen3.model,
        messages=QUESTION,
        max_tokens=60,
        temperature=0,
        extra_body={"regex": THINK_THEN_ANSWER, "include_reasoning": False},
    )
    shown = await qwen3_client.chat.completions.create(
        **{**kwargs, "extra_body": {"regex": THINK_THEN_ANSWER}}
    )
    whole = await qwen3_client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert shown.choices[0].message.model_extra["reasoning_content"]  # there is reasoning
    assert message.model_extra["reasoning_content"] is None
    assert message.content == shown.choices[0].message.content
    assert whole.usage and shown.usage  # still generated, and counted
    assert whole.usage.completion_tokens_details == shown.usage.completion_tokens_details
    stream = await qwen3_client.chat.completions.create(stream=True, **kwargs)
    content = ""
    async for chunk in stream:
        for choice in chunk.choices:
            assert not (choice.delta.model_extra or {}).get("reasoning_content")
            content += choice.delta.content or ""
    assert content == message.content


async def test_usage_counts_the_reasoning_tokens_whole_and_streamed(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    kwargs: dict[str, Any] = dict(
        model=qwen3.model,
        messages=QUESTION,
        max_tokens=60,
        temperature=0,
        extra_body={"regex": THINK_THEN_ANSWER},
    )
    whole = await qwen3_client.chat.completions.create(**kwargs)
    reasoning = whole.choices[0].message.model_extra["reasoning_content"]
    usage = whole.usage
    assert usage is not None and usage.completion_tokens_details is not None
    counted = usage.completion_tokens_details.reasoning_tokens
    assert counted == len(qwen3.engine.tokenizer.encode(reasoning))
    assert 0 < counted < usage.completion_tokens  # the answer's tokens are not counted
    stream = await qwen3_client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = [chunk async for chunk in stream]
    final = chunks[-1].usage
    assert final is not None and final.completion_tokens_details is not None
    assert final.completion_tokens_details.reasoning_tokens == counted
    plain = await qwen3_client.chat.completions.create(
        model=qwen3.model, messages=QUESTION, max_tokens=4, extra_body={"regex": "[a-z]{4}"}
    )
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


async def test_enable_thinking_false_reaches_the_template(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    async def prompt_tokens(**extra: Any) -> int:
        response = await qwen3_client.chat.completions.create(
            model=qwen3.model, messages=QUESTION, max_tokens=1, extra_body=extra
        )
        assert response.usage is not None
        return response.usage.prompt_tokens

    thinking = await prompt_tokens()
    # the template closes an empty think block in the prompt: <think>\n\n</think>\n\n
    assert await prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > thinking + 2


async def test_with_thinking_off_required_calls_come_without_a_think_block(
    qwen3_client: openai.AsyncOpenAI, qwen3: RunningServer
) -> None:
    """The bias pushes the model to open a think block; with enable_thinking false the
    grammar has none, so the output is the call at once (thinking on, the block is let in)."""
    bias = {str(_token(qwen3, "<think>")): 100}
    for thinking in (False, True):
        response = await qwen3_client.chat.completions.create(
            model=qwen3.model,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            logit_bias=bias,
            max_tokens=80,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        )
        choice = response.choices[0]
        reasoning = (choice.message.model_extra or {}).get("reasoning_content")
        if thinking:
            assert reasoning, choice  # the block was let in, and the bias opened it
            continue
        assert reasoning is None and choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        run_tool(call.function.name, call.function.arguments)


async def test_qwen3_server_leaks_nothing(qwen3: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(qwen3.engine))
    assert_no_leak(qwen3.engine)
