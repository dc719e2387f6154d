"""When a stream's headers go out: once the engine accepted the request, not at its first token
(a client or proxy waiting on headers must not time out behind a queue or a long prefill), and
not before its grammar compiled (a spec that does not compile is still a 400)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import pytest
import pytest_asyncio

from tests.openai_server import server  # noqa: F401  (fixture)
from tests.server_support import RunningServer, engine_idle, sse_json, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"


def bodies(model: str) -> dict[str, dict[str, Any]]:
    """One streamed request a route, each generating a few tokens."""
    user = [{"role": "user", "content": "Say something."}]
    return {
        CHAT: {"model": model, "messages": user, "max_tokens": 4, "stream": True},
        COMPLETIONS: {"model": model, "prompt": "Once", "max_tokens": 4, "stream": True},
        GENERATE: {"text": "Once", "sampling_params": {"max_new_tokens": 4}, "stream": True},
        MESSAGES: {"model": model, "messages": user, "max_tokens": 4, "stream": True},
        RESPONSES: {
            "model": model,
            "input": "Say something.",
            "max_output_tokens": 4,
            "stream": True,
        },
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(server: RunningServer) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def test_headers_go_out_before_the_first_token(
    http: aiohttp.ClientSession, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = server.engine.executor
    real_execute = executor.execute
    release = threading.Event()
    forwards_done = 0

    def held_execute(plan: Any) -> Any:
        nonlocal forwards_done
        assert release.wait(30), "the test never released the forward"
        forwards_done += 1
        return real_execute(plan)

    monkeypatch.setattr(executor, "execute", held_execute)
    responses = []
    try:
        for path, body in bodies(server.model).items():
            resp = await asyncio.wait_for(http.post(server.base_url + path, json=body), 10)
            responses.append(resp)
            assert resp.status == 200, path
            assert resp.headers["Content-Type"].startswith("text/event-stream"), path
        assert forwards_done == 0, "headers waited for a forward"
    finally:
        release.set()
    for resp in responses:
        raw = await resp.read()
        resp.release()
        assert raw.rstrip().endswith((b"data: [DONE]", b"}")), raw[-200:]
        assert b'"error":{' not in raw and b"event: error" not in raw, raw[-400:]
    assert forwards_done > 0
    assert await wait_until(lambda: engine_idle(server.engine))


def _held_forwards(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, list[int]]:
    """Every forward waits for the returned event; the list counts those done."""
    executor = server.engine.executor
    real_execute = executor.execute
    release = threading.Event()
    done = [0]

    def held_execute(plan: Any) -> Any:
        assert release.wait(30), "the test never released the forward"
        done[0] += 1
        return real_execute(plan)

    monkeypatch.setattr(executor, "execute", held_execute)
    return release, done


async def _first_event(resp: aiohttp.ClientResponse) -> tuple[str | None, Any]:
    """The first SSE event that is not a keep-alive: its ``event:`` name and its data."""
    while True:
        raw = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
        lines = dict(line.split(": ", 1) for line in raw.decode().split("\n") if ": " in line)
        if "data" in lines and lines.get("event") != "ping":
            return lines.get("event"), json.loads(lines["data"])


async def test_a_streams_header_event_goes_out_before_the_prefill_ends(
    http: aiohttp.ClientSession, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the hosted APIs and vLLM: Anthropic's ``message_start`` (with the prompt's usage),
    the chat stream's role chunk and ``response.created`` come once the request is scheduled,
    not with its first token, so a client's read timeout does not run out in a long prefill."""
    prompt_tokens = (await (await http.post(
        server.base_url + "/v1/messages/count_tokens",
        json={"model": server.model, "messages": [{"role": "user", "content": "Say something."}]},
    )).json())["input_tokens"]  # fmt: skip
    release, done = _held_forwards(server, monkeypatch)
    firsts: dict[str, tuple[str | None, Any]] = {}
    responses = []
    try:
        for path in (MESSAGES, CHAT, RESPONSES):
            resp = await http.post(server.base_url + path, json=bodies(server.model)[path])
            responses.append(resp)
            firsts[path] = await _first_event(resp)
        assert done[0] == 0, "a header event waited for a forward"
    finally:
        release.set()
    for resp in responses:
        await resp.read()
        resp.release()
    name, start = firsts[MESSAGES]
    assert name == "message_start" and start["message"]["content"] == []
    usage = start["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt_tokens
    _, chunk = firsts[CHAT]
    assert chunk["choices"][0]["delta"]["role"] == "assistant"
    assert firsts[RESPONSES][0] == "response.created"
    assert await wait_until(lambda: engine_idle(server.engine))


async def test_the_anthropic_client_reads_message_start_before_the_prefill_ends(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's stream yields ``message_start`` while the prefill runs, and the message it
    accumulates is the one ``create`` answers."""
    kwargs: dict[str, Any] = dict(
        model=server.model,
        max_tokens=6,
        messages=[{"role": "user", "content": "Name a colour."}],
        extra_body={"temperature": 0},
    )
    async with anthropic.AsyncAnthropic(
        base_url=server.base_url, api_key="unused", max_retries=0
    ) as claude:
        await claude.messages.create(**kwargs)  # the later two read the same cached part
        release, done = _held_forwards(server, monkeypatch)
        try:
            async with claude.messages.stream(**kwargs) as stream:
                events = aiter(stream)
                first = await asyncio.wait_for(anext(events), 10)
                assert done[0] == 0 and first.type == "message_start"
                started = first.message.usage.model_dump()  # the SDK updates it as it goes
                release.set()
                rest = [event.type async for event in events]
                final = await stream.get_final_message()
        finally:
            release.set()
        whole = await claude.messages.create(**kwargs)
    assert started == whole.usage.model_dump() | {"output_tokens": 0}
    assert rest[-2:] == ["message_delta", "message_stop"] and "message_start" not in rest
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert await wait_until(lambda: engine_idle(server.engine))


@pytest.mark.parametrize(
    ("path", "constrain", "says"),
    [
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "objec"}},
                }
            },
            "objec",
        ),
        (COMPLETIONS, {"regex": "[a-"}, "invalid regular expression"),
        (GENERATE, {"sampling_params": {"max_new_tokens": 4, "ebnf": "root ::= "}}, "invalid EBNF"),
        (
            RESPONSES,
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}},
            "objec",
        ),
    ],
)
async def test_a_grammar_that_does_not_compile_is_a_400_when_streamed(
    http: aiohttp.ClientSession, server: RunningServer, path: str, constrain: dict, says: str
) -> None:
    body = bodies(server.model)[path] | constrain
    async with http.post(server.base_url + path, json=body) as resp:
        assert resp.status == 400
        assert says in (await resp.json())["error"]["message"]
    assert await wait_until(lambda: engine_idle(server.engine))


async def test_headers_wait_for_the_grammar(
    http: aiohttp.ClientSession, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = bodies(server.model)[COMPLETIONS] | {"regex": "(yes|no)"}
    async with http.post(server.base_url + COMPLETIONS, json=body) as resp:
        assert resp.status == 200  # the compiler exists now
        await resp.read()
    compiler = server.engine.held.compiler
    release = threading.Event()
    real = compiler._compile_now
    monkeypatch.setattr(compiler, "_compile_now", lambda c: (release.wait(30), real(c))[1])
    body |= {"regex": "(maybe|never)", "max_tokens": 16}
    posting = asyncio.ensure_future(http.post(server.base_url + COMPLETIONS, json=body))
    try:
        await asyncio.sleep(0.3)
        assert not posting.done(), "headers went out before the grammar compiled"
    finally:
        release.set()
    async with await posting as resp:
        assert resp.status == 200
        chunks = sse_json(await resp.read())
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) in ("maybe", "never")
    assert await wait_until(lambda: engine_idle(server.engine))
