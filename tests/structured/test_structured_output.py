"""Structured output on the tiny random model: every output the grammar lets finish parses and
validates (greedy and sampled), through the Python API, the openai client (its pydantic
``parse`` helper included) and /generate; truncation is "length"; grammars compile off the loop,
once per spec, while other requests go on; a bad spec is a 400 that names the problem."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
import jsonschema
import openai
import pydantic
import pytest
import pytest_asyncio

from asyncengine.common.errors import InvalidRequestError
from asyncengine.common.sampling_params import SamplingParams, StructuredOutput
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

# Bounded schemas (short strings, few items, integer ranges): a random model cannot wander off
# inside an endless string, so its outputs end within MAX_TOKENS.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"enum": ["A1", "B2", "C3"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "lines", "paid"],
    "additionalProperties": False,
}
ANSWER: dict[str, Any] = {"enum": ["yes", "no", "maybe"]}
SCHEMAS = {"person": PERSON, "order": ORDER, "answer": ANSWER}
MAX_TOKENS = 200
PROMPT = "Describe one record as JSON."


def check_json(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(server: RunningServer) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(server.base_url) as session:
        yield session


# ------------------------------------------------------------------------ the Python API


@pytest.mark.parametrize("name", sorted(SCHEMAS))
async def test_greedy_and_sampled_outputs_validate(server: RunningServer, name: str) -> None:
    schema = SCHEMAS[name]
    constraint = StructuredOutput.json_schema(schema)
    runs = [SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, structured=constraint)]
    runs += [
        SamplingParams(temperature=1.0, seed=seed, max_new_tokens=MAX_TOKENS, structured=constraint)
        for seed in range(4)
    ]
    outputs = await asyncio.gather(*(server.engine.generate(PROMPT, p) for p in runs))
    for out in outputs:
        assert out.finish_reason == "stop", out
        check_json(out.text, schema)
    if name != "answer":  # three words: the tiny model may well pick one for every seed
        assert len({out.text for out in outputs[1:]}) > 1, "seeds should give different records"


async def test_properties_come_in_schema_order(server: RunningServer) -> None:
    params = SamplingParams(
        temperature=0.0, max_new_tokens=MAX_TOKENS, structured=StructuredOutput.json_schema(PERSON)
    )
    out = await server.engine.generate(PROMPT, params)
    assert list(json.loads(out.text)) == list(PERSON["properties"])


async def test_truncated_output_ends_with_length(server: RunningServer) -> None:
    params = SamplingParams(
        temperature=0.0, max_new_tokens=5, structured=StructuredOutput.json_schema(PERSON)
    )
    out = await server.engine.generate(PROMPT, params)
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"name":')


async def test_a_completed_grammar_stops_even_with_ignore_eos(server: RunningServer) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=MAX_TOKENS,
        ignore_eos=True,
        structured=StructuredOutput.json_schema(ORDER),
    )
    out = await server.engine.generate(PROMPT, params)
    assert out.finish_reason == "stop"
    check_json(out.text, ORDER)


async def test_regex_and_ebnf(server: RunningServer) -> None:
    for kind, spec, pattern in [
        ("regex", r"(yes|no) [0-9]{2}", r"(yes|no) [0-9]{2}"),
        ("ebnf", 'root ::= "<" ("a" | "b") ("a" | "b") ">"', r"<[ab]{2}>"),
    ]:
        for seed in range(3):
            params = SamplingParams(
                seed=seed, max_new_tokens=40, structured=StructuredOutput(kind, spec)
            )
            out = await server.engine.generate(PROMPT, params)
            assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out


async def test_json_object_is_json_or_truncated(server: RunningServer) -> None:
    params = SamplingParams(
        temperature=0.0, max_new_tokens=60, structured=StructuredOutput("json_object")
    )
    out = await server.engine.generate(PROMPT, params)
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        json.loads(out.text)
    else:
        assert out.finish_reason == "length"


async def test_grammar_compiles_once_per_spec(server: RunningServer) -> None:
    spec = StructuredOutput("regex", "[0-9]{3}")
    params = SamplingParams(max_new_tokens=10, structured=spec)
    await server.engine.generate(PROMPT, params)
    compiles = server.engine.held.compiler.compiles
    await asyncio.gather(*(server.engine.generate(PROMPT, params) for _ in range(3)))
    assert server.engine.held.compiler.compiles == compiles


async def test_compiling_request_waits_without_blocking_others(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.engine
    await engine.generate(
        PROMPT, SamplingParams(max_new_tokens=4, structured=StructuredOutput("regex", "a"))
    )
    compiler = engine.held.compiler
    release = threading.Event()
    real = compiler._compile_now

    def slow_compile(constraint: StructuredOutput) -> Any:
        assert release.wait(30)
        return real(constraint)

    monkeypatch.setattr(compiler, "_compile_now", slow_compile)
    spec = StructuredOutput("regex", "(red|green) [0-9]")
    waiting = asyncio.ensure_future(
        engine.generate(PROMPT, SamplingParams(max_new_tokens=10, structured=spec))
    )
    await asyncio.sleep(0)
    # the other request runs to the end while the grammar compiles
    other = await engine.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert other.finish_reason == "length" and not waiting.done()
    assert engine.stats()["waiting"] == 0, "the compiling request is not queued yet"
    release.set()
    out = await waiting
    assert re.fullmatch(r"(red|green) [0-9]", out.text)


async def test_abort_while_compiling_leaks_nothing(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.engine
    compiler = engine.held.compiler
    release = threading.Event()
    real = compiler._compile_now
    monkeypatch.setattr(compiler, "_compile_now", lambda c: (release.wait(30), real(c))[1])
    task = asyncio.ensure_future(
        engine.generate(
            PROMPT, SamplingParams(max_new_tokens=10, structured=StructuredOutput("regex", "b+"))
        )
    )
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert await wait_until(lambda: engine_idle(engine))
    assert not engine.streams.groups and not engine.streams.states


async def test_bad_spec_is_refused_by_the_engine(server: RunningServer) -> None:
    for constraint, says in [
        (StructuredOutput.json_schema({"type": "objec"}), 'Unsupported type "objec"'),
        (StructuredOutput("regex", "[a-"), "invalid regular expression"),
        (StructuredOutput("ebnf", "root ::= "), "invalid EBNF grammar"),
    ]:
        with pytest.raises(InvalidRequestError, match=re.escape(says)):
            await server.engine.generate(PROMPT, SamplingParams(structured=constraint))
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutput.json_schema("{oops")


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
async def test_constrained_requests_survive_retraction(
    tmp_path_factory: pytest.TempPathFactory, overlap: bool
) -> None:
    """A KV pool too small for all of them: requests are retracted and recomputed mid-output,
    their grammar state kept; the next forward may be launched before a step's tokens stream."""
    from asyncengine import AsyncEngine

    config = engine_config(
        tiny_model_dir(tmp_path_factory),
        page_size=4,
        kv_cache_tokens=160,
        chunked_prefill_size=8,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.01,
        enable_overlap_schedule=overlap,
    )
    async with AsyncEngine(config) as engine:
        engine.step_hooks.append(lambda plan: engine.scheduler.kv.check_invariant())
        params = [
            SamplingParams(
                seed=seed,
                max_new_tokens=MAX_TOKENS,
                structured=StructuredOutput.json_schema(ORDER if seed % 2 else PERSON),
            )
            for seed in range(4)
        ]
        outputs = await asyncio.gather(*(engine.generate(PROMPT, p) for p in params))
        assert engine.stats()["retractions"] > 0
        assert_no_leak(engine)
    for seed, out in enumerate(outputs):
        assert out.finish_reason == "stop"
        check_json(out.text, ORDER if seed % 2 else PERSON)


# ------------------------------------------------------------------------ the openai client


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_response_format_json_schema(
    client: openai.AsyncOpenAI, server: RunningServer, stream: bool
) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    kwargs: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": "An order, please."}],
        "max_tokens": MAX_TOKENS,
        "response_format": response_format,
    }
    for seed in range(3):
        if stream:
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    stream=True, seed=seed, **kwargs
                )
            ]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            resp = await client.chat.completions.create(seed=seed, **kwargs)
            text, finish = resp.choices[0].message.content or "", resp.choices[0].finish_reason
        assert finish == "stop"
        check_json(text, ORDER)


async def test_completions_response_format_and_json_object(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    resp = await client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
    )
    assert resp.choices[0].finish_reason == "stop"
    check_json(resp.choices[0].text, PERSON)
    resp2 = await client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "json"}],
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = resp2.choices[0].message.content or ""
    assert text.startswith("{")
    if resp2.choices[0].finish_reason == "stop":
        json.loads(text)


class Line(pydantic.BaseModel):
    sku: Literal["A1", "B2", "C3"]
    qty: int = pydantic.Field(ge=1, le=9)


class Order(pydantic.BaseModel):
    id: int = pydantic.Field(ge=1, le=999)
    lines: list[Line] = pydantic.Field(min_length=1, max_length=3)
    paid: bool


async def test_openai_parse_helper_with_a_pydantic_model(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    for seed in (0, 1):
        completion = await client.chat.completions.parse(
            model=server.model,
            messages=[{"role": "user", "content": "An order, please."}],
            response_format=Order,
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Order)
        assert 1 <= len(parsed.lines) <= 3


UNIQUE_TAGS: dict[str, Any] = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
}


async def test_a_schema_keyword_the_grammar_does_not_hold_is_a_400(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Tags, please."}],
            max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"schema": UNIQUE_TAGS}},
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert "'uniqueItems' at #/properties/tags" in error["message"]
    assert error["param"] == "response_format.json_schema.schema"
    # the Python API holds the same line
    with pytest.raises(InvalidRequestError, match="'uniqueItems' at #/properties/tags"):
        await server.engine.generate(
            PROMPT, SamplingParams(structured=StructuredOutput.json_schema(UNIQUE_TAGS))
        )


# ------------------------------------------------------------------------ /generate


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_json_schema_regex_ebnf(http: aiohttp.ClientSession, stream: bool) -> None:
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"json_schema": json.dumps(PERSON)}, PERSON),
        ({"json_schema": ORDER}, ORDER),  # an object is taken too
        ({"regex": "(yes|no) [0-9]{2}"}, r"(yes|no) [0-9]{2}"),
        ({"ebnf": 'root ::= "<" ("a" | "b")+ ">"'}, None),
    ]
    for constraint, expect in cases:
        body = {
            "text": PROMPT,
            "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, **constraint},
        }
        async with http.post("/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            if stream:
                final = sse_json(await resp.read())[-1]
            else:
                final = await resp.json()
        text = final["text"]
        if "ebnf" in constraint:
            if final["meta_info"]["finish_reason"]["type"] == "stop":
                assert re.fullmatch(r"<[ab]+>", text), text
            else:
                assert re.fullmatch(r"<[ab]*", text), text
            continue
        assert final["meta_info"]["finish_reason"]["type"] == "stop", final
        if isinstance(expect, str):
            assert re.fullmatch(expect, text), text
        else:
            check_json(text, expect)


async def test_nothing_leaks_after_the_module(server: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)
