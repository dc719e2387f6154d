"""A tool call on the chat APIs through their own clients over loopback, whole and streamed: a
streamed answer accumulates, as the SDK does it, to the whole one."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import RunningServer, assert_no_leak, engine_idle, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True}}
]
QUESTION = "What is the weather in Paris?"
MESSAGES = [{"role": "user", "content": QUESTION}]


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
