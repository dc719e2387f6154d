"""OpenAI's Responses API (``/v1/responses``, GET and DELETE by id, the pages of input items)
through the ``openai`` client over loopback, on the tiny random models: the same greedy text as
Chat Completions, streamed and whole, a two-round function-call loop by hand and by
``previous_response_id``, the store (``store: false``, API keys and users kept apart),
structured output, reasoning items, errors."""

from __future__ import annotations

import gc
import json
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio

from asyncengine.server.openai_responses import RESPONSES_STORE
from asyncengine.server.openai_schema import (
    MAX_METADATA_KEY_LENGTH,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_LENGTH,
)
from asyncengine.server.responses_schema import MAX_CONVERSATION_ITEMS
from tests.chat_models import tiny_thinking_qwen3_dir
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

QUESTION = "What is the weather in Paris?"
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather",
        "parameters": WEATHER_SCHEMA,
    }
]


async def test_the_same_greedy_text_as_chat_completions_whole_and_streamed(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    instructions = "You answer briefly."
    chat = await client.chat.completions.create(
        model=server.model,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=12,
        temperature=0,
    )
    kwargs: dict[str, Any] = dict(
        model=server.model,
        instructions=instructions,
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
        store=False,
    )
    whole = await client.responses.create(**kwargs)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.instructions == instructions and whole.max_output_tokens == 12
    assert whole.usage is not None and chat.usage is not None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == 12
    assert whole.usage.input_tokens_details.cached_tokens > 0  # left cached by the chat request

    events = []
    stream = await client.responses.create(stream=True, **kwargs)
    async for event in stream:
        events.append(event)
    names = [e.type for e in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]


async def test_the_function_call_loop_by_hand_and_by_previous_response_id(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, tools=TOOLS, temperature=0)
    first = await client.responses.create(
        input=QUESTION,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        **kwargs,
    )
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    (call,) = calls
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)  # the grammar made it valid

    stream = await client.responses.create(
        input=QUESTION,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        stream=True,
        **kwargs,
    )
    pieces, done = [], None
    async for event in stream:
        if event.type == "response.function_call_arguments.delta":
            pieces.append(event.delta)
        elif event.type == "response.function_call_arguments.done":
            done = event
        elif event.type == "response.completed":
            streamed = event.response
    assert done is not None and done.arguments == call.arguments == "".join(pieces)
    assert len(pieces) > 1
    assert [(i.type, getattr(i, "arguments", None)) for i in streamed.output] == [
        (i.type, getattr(i, "arguments", None)) for i in first.output
    ]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    by_hand = await client.responses.create(
        input=[
            {"role": "user", "content": QUESTION},
            *[item.model_dump(exclude_none=True) for item in first.output],
            result,
        ],
        tool_choice="none",
        max_output_tokens=8,
        **kwargs,
    )
    chained = await client.responses.create(
        input=[result],
        previous_response_id=first.id,
        tool_choice="none",
        max_output_tokens=8,
        **kwargs,
    )
    assert chained.previous_response_id == first.id
    assert by_hand.usage is not None and chained.usage is not None and first.usage is not None
    # the same conversation either way: the same prompt, the same greedy answer
    assert chained.usage.input_tokens == by_hand.usage.input_tokens
    assert chained.output_text == by_hand.output_text and chained.output_text
    assert [i.type for i in chained.output] == ["message"]
    # as in OpenAI's API, a call is answered before the conversation goes on
    for unanswered in (
        dict(input="Never mind.", previous_response_id=first.id),
        dict(input=[*[i.model_dump(exclude_none=True) for i in first.output]]),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(max_output_tokens=4, **unanswered, **kwargs)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "input", error
        assert f"answers the function_call {call.call_id!r}" in error["message"], error
    # a third turn continues the chain of two
    third = await client.responses.create(
        input="And Oslo?", previous_response_id=chained.id, max_output_tokens=4, **kwargs
    )
    assert third.usage is not None and third.usage.input_tokens > chained.usage.input_tokens + 4


async def test_the_store_get_delete_store_false_and_users(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, max_output_tokens=4, temperature=0)
    kept = await client.responses.create(input="hi", user="alice", metadata={"k": "v"}, **kwargs)
    fetched = await client.responses.retrieve(kept.id)
    assert fetched.model_dump() == kept.model_dump() and fetched.metadata == {"k": "v"}
    # another user cannot continue alice's conversation; neither can an anonymous request
    for user in ("bob", None):
        extra = {"user": user} if user else {}
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                input="more", previous_response_id=kept.id, **extra, **kwargs
            )
    await client.responses.create(
        input="more", previous_response_id=kept.id, user="alice", **kwargs
    )
    await client.responses.delete(kept.id)
    for gone in (client.responses.retrieve(kept.id), client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            await gone

    unstored = await client.responses.create(input="hi", store=False, **kwargs)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(input="more", previous_response_id=unstored.id, **kwargs)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_metadata_past_openais_bounds_is_a_400_naming_it(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """At most 16 pairs, keys of at most 64 characters, values of at most 512, on /v1/responses
    and on chat completions (stored there by OpenAI, validated alike here)."""
    too_long_key = {"k" * (MAX_METADATA_KEY_LENGTH + 1): "v"}
    too_long_value = {"k": "v" * (MAX_METADATA_VALUE_LENGTH + 1)}
    too_many = {f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)}
    at_the_bounds = {
        f"{i:0{MAX_METADATA_KEY_LENGTH}d}": "v" * MAX_METADATA_VALUE_LENGTH
        for i in range(MAX_METADATA_PAIRS)
    }
    say: Any = [{"role": "user", "content": "hi"}]
    for metadata in (too_long_key, too_long_value, too_many):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model=server.model, input="hi", max_output_tokens=1, metadata=metadata
            )
        assert refused.value.body["param"] == "metadata"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=server.model, messages=say, max_tokens=1, store=True, metadata=metadata
            )
        assert refused.value.body["param"] == "metadata"  # type: ignore[index]
    kept = await client.responses.create(
        model=server.model, input="hi", max_output_tokens=1, metadata=at_the_bounds
    )
    assert (await client.responses.retrieve(kept.id)).metadata == at_the_bounds
    chat = await client.chat.completions.create(
        model=server.model, messages=say, max_tokens=1, store=True, metadata=at_the_bounds
    )
    assert len(chat.choices) == 1  # served, the metadata at its bounds accepted


async def test_input_items_list_what_each_response_was_sent_a_page_at_a_time(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    sent: list[Any] = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'},
        {"type": "message", "role": "assistant", "content": "It is 21 degrees.", "id": "msg_mine"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    kwargs: dict[str, Any] = dict(model=server.model, max_output_tokens=4, temperature=0)
    first = await client.responses.create(input=sent, tools=TOOLS, tool_choice="none", **kwargs)
    page = await client.responses.input_items.list(first.id)
    assert page.object == "list" and page.has_more is False  # type: ignore[attr-defined]
    items = page.data[::-1]  # newest first by default
    assert [item.type for item in items] == [
        "message", "message", "function_call", "function_call_output", "message", "message"
    ]  # fmt: skip
    ids = [item.id for item in items]
    assert len(set(ids)) == 6 and ids[4] == "msg_mine" and ids[0].startswith("msg_")
    assert (page.first_id, page.last_id) == (ids[-1], ids[0])  # type: ignore[attr-defined]
    dumped = [item.model_dump(exclude_none=True) for item in items]
    assert dumped[0]["role"] == "developer"
    assert dumped[0]["content"] == [{"type": "input_text", "text": "Answer briefly."}]
    assert dumped[1]["content"] == [{"type": "input_text", "text": QUESTION}]
    assert dumped[2]["name"] == "get_weather" and dumped[2]["call_id"] == "call_1"
    assert dumped[3]["output"] == '{"temp": 21}' and dumped[3]["call_id"] == "call_1"
    assert dumped[4]["role"] == "assistant"
    assert dumped[4]["content"][0]["text"] == "It is 21 degrees."
    assert all(item["status"] == "completed" for item in dumped)

    # pages of 4, oldest first: the client follows ``after`` to the end
    pager = client.responses.input_items.list(first.id, limit=4, order="asc")
    assert [item.id async for item in pager] == ids
    head = await client.responses.input_items.list(first.id, limit=4, order="asc")
    assert [i.id for i in head.data] == ids[:4] and head.has_more
    tail = await client.responses.input_items.list(first.id, limit=4, after=ids[2])
    assert [i.id for i in tail.data] == ids[1::-1] and tail.has_more is False
    before = await client.responses.input_items.list(
        first.id, limit=2, order="asc", extra_query={"before": ids[4]}
    )
    assert [i.id for i in before.data] == ids[2:4] and before.has_more

    # a continued response lists its own input alone, not its chain's
    second = await client.responses.create(
        input="And Oslo?", previous_response_id=first.id, **kwargs
    )
    (only,) = (await client.responses.input_items.list(second.id)).data
    assert only.model_dump(exclude_none=True)["content"] == [
        {"type": "input_text", "text": "And Oslo?"}
    ]

    refusals = [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"),
                ({"order": "sideways"}, "order"), ({"after": "msg_nope"}, "after")]  # fmt: skip
    for query, param in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.input_items.list(first.id, extra_query=query)
        assert refused.value.body["param"] == param  # type: ignore[index]
    unstored = await client.responses.create(input="hi", store=False, **kwargs)
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list(missing)


async def test_another_api_key_neither_reads_continues_nor_deletes(server: RunningServer) -> None:
    keyed = await start_server(server.engine.config, engine=server.engine, api_key=["ka", "kb"])
    url = keyed.base_url + "/v1"
    try:
        async with (
            openai.AsyncOpenAI(base_url=url, api_key="ka", max_retries=0) as a,
            openai.AsyncOpenAI(base_url=url, api_key="kb", max_retries=0) as b,
        ):
            kwargs: dict[str, Any] = dict(model=server.model, max_output_tokens=4, user="alice")
            kept = await a.responses.create(input="My password is hunter2.", **kwargs)
            for other in (
                b.responses.retrieve(kept.id),
                b.responses.input_items.list(kept.id),
                b.responses.delete(kept.id),
                b.responses.create(input="more", previous_response_id=kept.id, **kwargs),
            ):
                with pytest.raises(openai.NotFoundError):
                    await other
            assert (await a.responses.retrieve(kept.id)).id == kept.id
            (item,) = (await a.responses.input_items.list(kept.id)).data
            assert item.content[0].text == "My password is hunter2."  # type: ignore[union-attr]
            await a.responses.create(input="more", previous_response_id=kept.id, **kwargs)
            await a.responses.delete(kept.id)
    finally:
        await keyed.stop(stop_engine=False)


async def test_a_key_that_fills_the_store_evicts_its_own_responses(server: RunningServer) -> None:
    keyed = await start_server(
        server.engine.config,
        engine=server.engine,
        api_key=["ka", "kb"],
        responses_store_bytes=32 * 1024,
    )
    store = keyed.app[RESPONSES_STORE]
    url = keyed.base_url + "/v1"
    try:
        async with (
            openai.AsyncOpenAI(base_url=url, api_key="ka", max_retries=0) as a,
            openai.AsyncOpenAI(base_url=url, api_key="kb", max_retries=0) as b,
        ):
            kwargs: dict[str, Any] = dict(model=server.model, max_output_tokens=1)
            kept = await b.responses.create(input="B's conversation", **kwargs)
            flood = [(await a.responses.create(input="x " * 100, **kwargs)).id for _ in range(40)]
            assert store.bytes <= store.max_bytes
            with pytest.raises(openai.NotFoundError):
                await a.responses.retrieve(flood[0])  # the flood evicted its own oldest
            assert (await b.responses.retrieve(kept.id)).id == kept.id
            assert (await a.responses.retrieve(flood[-1])).id == flood[-1]
    finally:
        await keyed.stop(stop_engine=False)


async def test_a_json_schema_text_format_is_structured_output(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    response = await client.responses.create(
        model=server.model,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA}},
        max_output_tokens=40,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER_SCHEMA)
    assert response.text is not None and response.text.format.type == "json_schema"


async def test_a_text_format_beside_a_forced_function_call_is_served(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    # instructor's RESPONSES_TOOLS mode sends both: the call is the output, no text to format
    fmt = {"type": "json_schema", "name": "weather", "strict": True, "schema": WEATHER_SCHEMA}
    response = await client.responses.create(
        model=server.model,
        input=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": fmt},  # type: ignore[typeddict-item]
        max_output_tokens=60,
        temperature=0,
    )
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


async def test_completed_at_is_set_once_completed_and_the_objects_fields_are_filled(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    schema = {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA}
    kwargs: dict[str, Any] = dict(
        model=server.model, input=QUESTION, text={"format": schema}, temperature=0
    )
    raw = await client.responses.with_raw_response.create(max_output_tokens=40, **kwargs)
    body = raw.http_response.json()
    assert body["status"] == "completed"
    assert isinstance(body["completed_at"], int) and body["completed_at"] >= body["created_at"]
    filled = {"background": False, "conversation": None, "prompt": None, "top_logprobs": 0}
    filled |= {"service_tier": "default", "max_tool_calls": None, "safety_identifier": None}
    assert {key: body.get(key, "absent") for key in filled} == filled
    stored = await client.responses.retrieve(body["id"])
    assert stored.completed_at == body["completed_at"]

    events = [
        e async for e in await client.responses.create(stream=True, max_output_tokens=40, **kwargs)
    ]
    assert events[0].response.completed_at is None  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed" and final.completed_at is not None
    cut = await client.responses.create(max_output_tokens=2, **kwargs)
    assert cut.status == "incomplete" and cut.completed_at is None


async def test_function_tools_are_strict_unless_strict_is_false(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """OpenAI's default in this API: a schema keyword the grammar cannot hold is refused even
    under "auto", and a schema whose strict was left out has its properties all required."""
    tagging = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }
    tool: dict[str, Any] = {"type": "function", "name": "tag", "parameters": tagging}
    kwargs: dict[str, Any] = dict(model=server.model, input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(tools=[tool], **kwargs)
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_schema_keyword"
    assert "uniqueItems" in error["message"] and error["param"] == "tools[0].parameters", error
    served = await client.responses.create(tools=[{**tool, "strict": False}], **kwargs)
    assert served.tools[0].strict is False  # type: ignore[union-attr]

    optional = {**WEATHER_SCHEMA, "required": []}
    weather = {"type": "function", "name": "get_weather", "parameters": optional}
    response = await client.responses.create(
        model=server.model,
        input=QUESTION,
        tools=[weather],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    assert response.tools[0].strict is True  # type: ignore[union-attr]
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert set(json.loads(call.arguments)) == set(optional["properties"])


async def test_refusals_name_the_field(client: openai.AsyncOpenAI, server: RunningServer) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    unique = {"type": "json_schema", "name": "u", "schema": {"type": "array", "uniqueItems": True}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": [{"role": "user", "content": [image]}]}, "input[0].content[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "prompt": {"id": "pmpt_abc", "variables": {"city": "Oslo"}}}, "prompt"),
        ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input[0].call_id",
        ),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": unique}}, "text.format.schema"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ]
    for body, param in cases:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(model=server.model, **body)
        assert refused.value.status_code in (400, 404), body
        assert refused.value.body["param"] == param, (body, refused.value.body)  # type: ignore[index]
        assert "response_format" not in refused.value.message, refused.value.message


async def test_a_conversation_holds_what_one_request_could_send(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """Continuing a conversation reads back its whole stored chain, so a chain is continued
    only while it is no larger than one request's input could be: MAX_CONVERSATION_ITEMS items
    (an input too) and the body limit in JSON bytes; past either a 400 that names
    previous_response_id. Reasoning items stand in for what the prompt leaves out."""
    kwargs: dict[str, Any] = dict(model=server.model, max_output_tokens=1)
    say: Any = {"role": "user", "content": "hi"}
    thoughts: Any = [{"type": "reasoning", "summary": []}] * MAX_CONVERSATION_ITEMS
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(input=[*thoughts, say], **kwargs)
    assert refused.value.body["param"] == "input"  # type: ignore[index]

    half = [*thoughts[: MAX_CONVERSATION_ITEMS // 2], say]
    first = await client.responses.create(input=half, **kwargs)
    second = await client.responses.create(input=half, previous_response_id=first.id, **kwargs)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(input="hi", previous_response_id=second.id, **kwargs)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert f"more than {MAX_CONVERSATION_ITEMS} items" in refused.value.message

    limit = 32 * 1024
    small = await start_server(server.engine.config, engine=server.engine, max_body_bytes=limit)
    async with openai.AsyncOpenAI(base_url=small.base_url + "/v1", api_key="x") as near:
        try:
            thought: Any = [{"type": "reasoning", "summary": [], "content": "x" * 12000}, say]
            previous = None
            for _ in range(3):  # 12 KB a turn: two fit the 32 KiB limit, the third does not
                previous = (
                    await near.responses.create(
                        input=thought, previous_response_id=previous, **kwargs
                    )
                ).id
            with pytest.raises(openai.BadRequestError) as refused:
                await near.responses.create(input="hi", previous_response_id=previous, **kwargs)
            assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
            assert f"{limit} bytes" in refused.value.message
        finally:
            await small.stop(stop_engine=False)


async def test_the_store_holds_no_more_memory_than_the_bytes_it_counts(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """Its bound is in JSON bytes: what it holds (measured as what deleting its responses frees)
    stays near that, where decoded items would take several times their JSON."""
    store = server.app[RESPONSES_STORE]
    conversation: Any = [{"role": "user", "content": "hi"}] * 70
    tracemalloc.start()
    try:
        ids = [
            (
                await client.responses.create(
                    model=server.model, input=conversation, max_output_tokens=1
                )
            ).id
            for _ in range(80)
        ]
        counted = store.bytes
        gc.collect()
        holding = tracemalloc.get_traced_memory()[0]
        for response_id in ids:
            await client.responses.delete(response_id)
        counted -= store.bytes
        gc.collect()
        freed = holding - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert counted > 100_000
    assert freed < 1.5 * counted, (freed, counted)


async def test_nothing_leaks_after_the_responses(server: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def thinker(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    running = await start_server(engine_config(tiny_thinking_qwen3_dir(tmp_path_factory)))
    yield running
    await running.stop()


async def test_reasoning_comes_as_a_reasoning_item_whole_and_streamed(
    thinker: RunningServer,
) -> None:
    async with openai.AsyncOpenAI(
        base_url=thinker.base_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        kwargs: dict[str, Any] = dict(
            model=thinker.model, input=QUESTION, max_output_tokens=10, temperature=0
        )
        whole = await c.responses.create(**kwargs)
        (item,) = whole.output
        assert item.type == "reasoning" and item.content is not None
        (part,) = item.content
        assert part.type == "reasoning_text" and part.text.strip() and "<think>" not in part.text
        assert whole.usage is not None
        assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= 10
        # Chat Completions counts the same greedy output's reasoning the same
        chat = await c.chat.completions.create(
            model=thinker.model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=10,
            temperature=0,
        )
        assert chat.usage is not None and chat.usage.completion_tokens_details is not None
        assert chat.choices[0].message.model_extra["reasoning_content"] == part.text
        assert (
            chat.usage.completion_tokens_details.reasoning_tokens
            == whole.usage.output_tokens_details.reasoning_tokens
        )
        stream = await c.responses.create(stream=True, **kwargs)
        deltas = []
        async for event in stream:
            if event.type == "response.reasoning_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.incomplete":
                streamed = event.response
        assert len(deltas) > 1 and "".join(deltas) == part.text
        assert streamed.output[0].model_dump(exclude={"id"}) == item.model_dump(exclude={"id"})
        # effort "none": the template closes the think block in the prompt
        plain = await c.responses.create(reasoning={"effort": "none"}, **kwargs)
        assert [i.type for i in plain.output] == ["message"]
        # a reasoning item given back is dropped, as the template drops earlier reasoning
        turn = [{"role": "user", "content": QUESTION}]
        answer = {"role": "assistant", "content": "Hi"}
        counts = []
        for given in ([item.model_dump(exclude_none=True)], []):
            again = await c.responses.create(
                model=thinker.model,
                input=[*turn, *given, answer, {"role": "user", "content": "And Oslo?"}],
                max_output_tokens=1,
            )
            assert again.usage is not None
            counts.append(again.usage.input_tokens)
        assert counts[0] == counts[1]
    assert await wait_until(lambda: engine_idle(thinker.engine))
    assert_no_leak(thinker.engine)
