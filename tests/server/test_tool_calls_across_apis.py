"""A tool call on the three chat APIs (Chat Completions, Anthropic Messages, Responses) through
their own clients over loopback, whole and streamed: a call cut by the output budget is reported
the same way on each (the finish reason says length, the call is never a finished one), and a
streamed answer accumulates, as the SDK does it, to the whole one."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import openai
import pytest

from tests.openai_server import claude, client, server  # noqa: F401  (fixtures)
from tests.server.test_tool_calls_server import WEATHER_SCHEMA
from tests.server_support import RunningServer, assert_no_leak, engine_idle, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

SCHEMA = WEATHER_SCHEMA
# the same tool on each API, strict everywhere, so that each renders the same prompt
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True}}
]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": SCHEMA, "strict": True}]
RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}
]
QUESTION = "What is the weather in Paris?"
MESSAGES = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def _chat(client: openai.AsyncOpenAI, server: RunningServer, max_tokens: int) -> Any:
    return await client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=CHAT_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=max_tokens,
        temperature=0,
    )


def _whole_members(cut: str) -> dict[str, Any] | None:
    """The members before the last comma of arguments cut inside their last member (None when
    the cut is elsewhere)."""
    if "," not in cut or _is_json(cut) or _is_json(cut + "}"):
        return None
    return dict(json.loads(cut[: cut.rindex(",")] + "}"))


async def _cut_budget(client: openai.AsyncOpenAI, server: RunningServer) -> int:
    """A budget that ends the greedy call inside its second member."""
    whole = await _chat(client, server, 80)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.usage is not None
    for budget in range(whole.usage.completion_tokens - 1, 0, -1):
        calls = (await _chat(client, server, budget)).choices[0].message.tool_calls or []
        if calls and _whole_members(calls[0].function.arguments):
            return budget
    raise AssertionError("no budget cuts the call inside its second member")


async def test_a_call_cut_by_the_budget_is_reported_as_cut_on_every_api(
    client: openai.AsyncOpenAI, claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    budget = await _cut_budget(client, server)

    # Chat Completions, as OpenAI's: finish_reason "length", the arguments as far as written
    whole = await _chat(client, server, budget)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    cut = call.function.arguments
    first_member = _whole_members(cut)
    assert first_member and not _is_json(cut)
    stream = await client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=CHAT_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=budget,
        temperature=0,
        stream=True,
    )
    pieces, reasons = [], []
    async for chunk in stream:
        for streamed in chunk.choices:
            pieces += streamed.delta.tool_calls or []
            reasons.append(streamed.finish_reason)
    assert reasons[-1] == "length"
    assert "".join(p.function.arguments or "" for p in pieces) == cut

    # Anthropic, as Anthropic's: stop_reason "max_tokens", the incomplete tool_use block with
    # the members written whole (what the client reads from the stream's partial_json)
    kwargs: dict[str, Any] = dict(
        model=server.model,
        max_tokens=budget,
        messages=MESSAGES,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    message = await claude.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    (block,) = message.content
    assert block.type == "tool_use" and block.input == first_member
    async with claude.messages.stream(**kwargs) as events:
        streamed_message = await events.get_final_message()
    assert streamed_message.stop_reason == "max_tokens"
    (streamed_block,) = streamed_message.content
    assert streamed_block.type == "tool_use" and streamed_block.input == block.input

    # Responses, as OpenAI's: status "incomplete" (max_output_tokens), the call item too
    request: dict[str, Any] = dict(
        model=server.model,
        input=QUESTION,
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=budget,
        temperature=0,
        store=False,
    )
    response = await client.responses.create(**request)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert item.arguments == cut
    events_seen = [event async for event in await client.responses.create(stream=True, **request)]
    assert events_seen[-1].type == "response.incomplete"
    done = [e for e in events_seen if e.type == "response.output_item.done"]
    assert [(e.item.status, e.item.arguments) for e in done] == [("incomplete", cut)]  # type: ignore[union-attr]


async def test_a_call_cut_right_after_its_name_is_reported_on_every_api(
    client: openai.AsyncOpenAI, claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    """Not dropped: each API reports the named call with no arguments, as cut."""
    budget = await _name_only_budget(client, server)
    choice = (await _chat(client, server, budget)).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", "")

    message = await claude.messages.create(
        model=server.model,
        max_tokens=budget,
        messages=MESSAGES,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "max_tokens"
    (block,) = message.content
    assert block.type == "tool_use" and (block.name, block.input) == ("get_weather", {})

    response = await client.responses.create(
        model=server.model,
        input=QUESTION,
        tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=budget,
        temperature=0,
        store=False,
    )
    assert response.status == "incomplete"
    (item,) = response.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert (item.name, item.arguments) == ("get_weather", "")


async def _name_only_budget(client: openai.AsyncOpenAI, server: RunningServer) -> int:
    """A budget that ends the greedy call after its name, before its arguments (read from the
    tokens' text, whatever the server makes of the call)."""
    for budget in range(1, 80):
        answer = await client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=CHAT_TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=budget,
            temperature=0,
            logprobs=True,
        )
        logprobs = answer.choices[0].logprobs
        assert logprobs is not None and logprobs.content is not None
        text = "".join(t.token for t in logprobs.content)
        if re.search(r'"name"\s*:\s*"get_weather"', text):
            assert not re.search(r'"arguments"\s*:\s*\{', text), text
            return budget
    raise AssertionError("no budget cuts the call after its name")


async def test_a_streamed_answer_accumulates_to_the_whole_one(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """The openai client's stream helper gives the same message as the whole answer: a call
    only answer has content null (its deltas carry content null), a text one its text."""
    for choice in ("required", "auto"):
        kwargs: dict[str, Any] = dict(
            model=server.model,
            messages=MESSAGES,
            tools=CHAT_TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=80,
            stop=["e"],  # the text answer ends on its own (the helper refuses a length cut)
            temperature=0,
        )
        whole = (await client.chat.completions.create(**kwargs)).choices[0]
        async with client.chat.completions.stream(**kwargs) as stream:
            async for event in stream:
                if event.type == "chunk" and event.chunk.choices:
                    delta = event.chunk.choices[0].delta
                    if delta.tool_calls:
                        assert "content" in delta.model_fields_set and delta.content is None
            final = await stream.get_final_completion()
        streamed = final.choices[0]
        assert streamed.message.role == "assistant"
        assert streamed.message.content == whole.message.content, choice
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert [
            (c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []
        ] == calls
        assert streamed.finish_reason == whole.finish_reason
        assert (whole.message.content is None) == (choice == "required")


async def test_nothing_leaks_after_the_cut_calls(server: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)
