"""A liveness probe answers while the server holds its limit of open connections, over real
loopback TCP: a few connections past ``max_open_connections`` may each send one whole
``GET /health`` head and are served it, then closed; anything else past the cap (another
path, a slow or long head, a second request) is the 503 the cap answers, and the sockets the
server holds never pass the cap by more than the probe slots."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio
from aiohttp import web

from asyncengine.server.app import create_app
from asyncengine.server.connection_limits import PROBE_SECONDS, PROBE_SLOTS
from asyncengine.server.serve import start_http
from asyncengine.server.state import STATE
from tests.api.test_engine_loop import fake_engine
from tests.server_support import wait_until

CAP = 3
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
CHAT = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b'Content-Length: 56\r\n\r\n{"messages": [{"role": "user", "content": "hi"}], "n": 1}'
)


class Capped:
    def __init__(self, runner: web.AppRunner, port: int, held: list[asyncio.StreamWriter]):
        self.runner, self.port, self.held = runner, port, held

    @property
    def open_sockets(self) -> int:
        """The connections the server holds: served ones and probe slots."""
        cap = next(iter(self.runner.sites))._connections  # type: ignore[attr-defined]
        return int(cap.open + len(cap.probes))

    @property
    def refused(self) -> float:
        return self.runner.app[STATE].metrics.counter_value("asyncengine_connections_refused_total")


@pytest_asyncio.fixture
async def capped() -> AsyncIterator[Capped]:
    """A server whose open-connection cap is held by clients that sent half a head."""
    engine = fake_engine()
    await engine.start()
    runner, port = await start_http(create_app(engine), "127.0.0.1", 0, max_open_connections=CAP)
    held = []
    for _ in range(CAP):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        held.append(writer)
    server = Capped(runner, port, held)
    try:
        assert await wait_until(lambda: server.open_sockets == CAP, timeout=30)
        yield server
    finally:
        for writer in held:
            writer.close()
        await runner.cleanup()
        await engine.stop()


async def _exchange(port: int, request: bytes, wait: float = 10.0) -> bytes:
    """What the server answers ``request`` on a fresh connection, read until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), wait)
    finally:
        writer.close()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_health_is_served_past_the_cap_and_nothing_else_is(capped: Capped) -> None:
    for _ in range(3):  # again and again: each probe's connection is closed after its answer
        answer = await _exchange(capped.port, HEALTH)
        assert _status(answer) == 200 and answer.endswith(b'{"status":"ok"}'), answer
    for request in (
        CHAT,
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /health?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        HEALTH + HEALTH,  # a second request behind it
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n",
    ):
        answer = await _exchange(capped.port, request)
        assert _status(answer) == 503 and b"too_many_open_connections" in answer, request[:40]
    assert capped.refused == 7
    assert await wait_until(lambda: capped.open_sockets == CAP)


async def test_a_probe_head_sent_a_byte_at_a_time_is_served(capped: Capped) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", capped.port)
    try:
        for byte in HEALTH:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)
        answer = await asyncio.wait_for(reader.read(), 10)
        assert _status(answer) == 200, answer
    finally:
        writer.close()


async def test_a_probe_slot_is_closed_after_its_one_answer(capped: Capped) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", capped.port)
    try:
        writer.write(HEALTH)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(HEALTH)  # keep-alive: a second request on a probe's connection
        rest = await asyncio.wait_for(reader.read(), 10)  # closed, not answered again
        assert rest.count(b"HTTP/1.1") == 0, rest
    finally:
        writer.close()
    assert await wait_until(lambda: capped.open_sockets == CAP)


async def test_slow_or_idle_connections_do_not_hold_the_probe_slots(capped: Capped) -> None:
    """Connections that send nothing take the slots, each for PROBE_SECONDS at most, and a
    new connection takes the place of the oldest: a probe still answers behind them."""
    loop = asyncio.get_running_loop()
    idle = []
    for _ in range(2 * PROBE_SLOTS):
        reader, writer = await asyncio.open_connection("127.0.0.1", capped.port)
        idle.append((reader, writer))
    try:
        assert await wait_until(lambda: capped.open_sockets == CAP + PROBE_SLOTS)
        started = loop.time()
        answer = await _exchange(capped.port, HEALTH)
        assert _status(answer) == 200, answer
        assert capped.open_sockets <= CAP + PROBE_SLOTS
        for reader, _ in idle:  # every idle one was refused: given way, or out of time
            answer = await asyncio.wait_for(reader.read(), 10)
            assert _status(answer) == 503 and b"too_many_open_connections" in answer
        # the last of them (never given way) waited its PROBE_SECONDS
        assert loop.time() - started <= PROBE_SECONDS + 5
    finally:
        for _, writer in idle:
            writer.close()
    assert await wait_until(lambda: capped.open_sockets == CAP)


async def test_a_half_sent_probe_head_is_refused_after_its_time(capped: Capped) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    answer = await _exchange(capped.port, HEALTH[:20])
    waited = loop.time() - started
    assert _status(answer) == 503
    assert PROBE_SECONDS * 0.9 <= waited <= PROBE_SECONDS + 5


async def test_a_probe_past_the_cap_says_what_the_health_route_says(capped: Capped) -> None:
    """It is the app's own /health: a server that is going down answers 503 there too."""
    capped.runner.app[STATE].shutting_down = True
    answer = await _exchange(capped.port, HEALTH)
    assert _status(answer) == 503 and b"shutting_down" in answer
