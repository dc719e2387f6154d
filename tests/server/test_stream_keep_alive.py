"""Keep-alives on a stream that sends nothing for a while (a long prefill): every SSE route
writes them (a comment line; Anthropic's route a ``ping`` event) while it is silent for the
server's ``stream_keep_alive`` seconds, the openai and anthropic clients read the same events
as without them, 0 sends none, and the timer ends with its stream."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio

from asyncengine.server.app import create_app
from asyncengine.server.keep_alive import COMMENT_FRAME, PING_FRAME
from asyncengine.server.state import STATE
from tests.openai_server import claude, client, server  # noqa: F401  (fixtures)
from tests.server_support import RunningServer, engine_idle, split_sse, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

INTERVAL = 0.05  # seconds of silence before a keep-alive
PREFILL_DELAY = 0.6  # the first forward of a request waits this long: a slow prefill

USER = [{"role": "user", "content": "Say something."}]
OPENAI_ROUTES = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 4, "stream": True},
    "/v1/completions": {"prompt": "Once", "max_tokens": 4, "stream": True},
    "/v1/responses": {"input": "Say something.", "max_output_tokens": 4, "stream": True},
    "/generate": {"text": "Once", "sampling_params": {"max_new_tokens": 4}, "stream": True},
}
MESSAGES = "/v1/messages"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(server: RunningServer) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def slow_prefill(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every forward that prefills (extends) a prompt takes PREFILL_DELAY seconds more."""
    executor = server.engine.executor
    real_execute = executor.execute

    def slow_execute(plan: Any) -> Any:
        if plan.extends:
            time.sleep(PREFILL_DELAY)
        return real_execute(plan)

    monkeypatch.setattr(executor, "execute", slow_execute)
    yield


def keep_alive_every(
    server: RunningServer, seconds: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.app[STATE], "stream_keep_alive", seconds)


async def raw_stream(http: aiohttp.ClientSession, server: RunningServer, path: str) -> bytes:
    body = {"model": server.model, **(OPENAI_ROUTES.get(path) or {"messages": USER})}
    if path == MESSAGES:
        body |= {"max_tokens": 4, "stream": True}
    async with http.post(server.base_url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


def beats() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "_beat"]  # type: ignore[union-attr]


@pytest.mark.parametrize("path", [*OPENAI_ROUTES, MESSAGES])
async def test_a_slow_prefill_gets_keep_alives_and_every_event_stays_whole(
    http: aiohttp.ClientSession,
    server: RunningServer,
    slow_prefill: None,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    keep_alive = PING_FRAME if path == MESSAGES else COMMENT_FRAME
    keep_alive_every(server, INTERVAL, monkeypatch)
    raw = await raw_stream(http, server, path)
    assert keep_alive * 3 in raw, raw[:300]  # the silent prefill: nothing else in between
    if path == MESSAGES:  # as Anthropic's: message_start, then pings while the prefill runs
        start = raw.index(b"event: message_start\n")
        assert raw[:start] == PING_FRAME * (start // len(PING_FRAME)), raw[:300]  # queued
        assert raw[start:].partition(b"\n\n")[2].startswith(PING_FRAME * 3), raw[:300]
    assert not beats()
    keep_alive_every(server, 0, monkeypatch)
    quiet = await raw_stream(http, server, path)
    assert keep_alive not in quiet and b"\n: " not in quiet and not quiet.startswith(b":")
    if path != MESSAGES and path != "/v1/responses":
        split_sse(raw.replace(keep_alive, b""))  # well formed once the keep-alives are left out


async def _chat_chunks(client: openai.AsyncOpenAI, model: str) -> list[dict[str, Any]]:
    stream = await client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=6,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    return [chunk.model_dump(exclude={"id", "created"}) async for chunk in stream]


async def _completion_text(client: openai.AsyncOpenAI, model: str) -> list[str]:
    stream = await client.completions.create(
        model=model, prompt="Once", max_tokens=6, temperature=0, stream=True
    )
    return [choice.text async for chunk in stream for choice in chunk.choices]


async def _messages_events(claude: anthropic.AsyncAnthropic, model: str) -> list[Any]:
    async with claude.messages.stream(
        model=model,
        messages=USER,  # type: ignore[arg-type]
        max_tokens=6,
        extra_body={"temperature": 0},
    ) as stream:
        events = [event.model_dump(exclude={"message"}) async for event in stream]
        final = await stream.get_final_message()
    return [*events, final.model_dump(exclude={"id"})]


async def test_the_clients_read_the_same_events_with_keep_alives(
    client: openai.AsyncOpenAI,
    claude: anthropic.AsyncAnthropic,
    server: RunningServer,
    slow_prefill: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = []
    for seconds in (INTERVAL, 0.0):
        keep_alive_every(server, seconds, monkeypatch)
        results.append(
            (
                await _chat_chunks(client, server.model),
                await _completion_text(client, server.model),
                await _messages_events(claude, server.model),
            )
        )
    with_keep_alives, without = results
    assert with_keep_alives == without
    chat, text, events = with_keep_alives
    assert len(chat) > 2 and "".join(text) and events[0]["type"] == "message_start"


async def test_a_client_that_leaves_ends_the_timer_with_its_stream(
    http: aiohttp.ClientSession,
    server: RunningServer,
    slow_prefill: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keep_alive_every(server, 4 * INTERVAL, monkeypatch)  # a beat that sleeps past the stream's end
    body = {"model": server.model, "prompt": "Once", "max_tokens": 200, "stream": True}
    async with http.post(server.base_url + "/v1/completions", json=body) as resp:
        assert await resp.content.readuntil(b"\n\n") == COMMENT_FRAME
        assert len(beats()) == 1
        resp.close()  # the client goes away mid-stream
    assert await wait_until(lambda: engine_idle(server.engine), timeout=10)
    await asyncio.sleep(0)  # the handler's last step after it aborted the request
    assert not beats()


async def test_a_stream_that_ends_leaves_no_timer(
    http: aiohttp.ClientSession, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep_alive_every(server, 30.0, monkeypatch)
    raw = await raw_stream(http, server, "/v1/chat/completions")
    assert COMMENT_FRAME not in raw
    assert not beats()


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf])
async def test_a_bad_interval_is_refused(server: RunningServer, seconds: float) -> None:
    with pytest.raises(ValueError, match="stream_keep_alive"):
        create_app(server.engine, stream_keep_alive=seconds)
