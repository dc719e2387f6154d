"""The server against a hostile client or web page, over real HTTP on 127.0.0.1: state changes
are never a GET, JSON routes take only bodies declared JSON, a foreign Host or Origin is
refused, failures return an error id instead of their text, client values are escaped in the
log, large inputs are tokenized off the loop, and clients that stop reading are dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from asyncengine.server.app import create_app
from asyncengine.server.connection_limits import LIMITS, default_max_open_connections
from asyncengine.server.off_loop import LARGE_INPUT_CHARS
from asyncengine.server.state import STATE
from tests.server_support import (
    RunningServer,
    engine_config,
    engine_idle,
    start_server,
    tiny_model_dir,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
ADMIN_TOKEN = "hardening-admin"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    config = engine_config(tiny_model_dir(tmp_path_factory), max_model_len=2048)
    running = await start_server(config, admin_token=ADMIN_TOKEN)
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def _status(
    http: aiohttp.ClientSession, method: str, url: str, **kwargs: Any
) -> tuple[int, dict[str, Any]]:
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


# -- state changes are POST only ---------------------------------------------------------------


async def test_flush_cache_is_post_only(http: aiohttp.ClientSession, server: RunningServer) -> None:
    status, body = await _status(http, "GET", server.base_url + "/flush_cache")
    assert status == 405 and "allowed: POST" in body["error"]["message"]
    status, _ = await _status(
        http,
        "POST",
        server.base_url + "/flush_cache",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert status == 200


async def test_no_get_route_changes_state(server: RunningServer) -> None:
    """Every GET route is a read (health_generate runs one token through the engine, as a probe,
    and changes nothing a client can see)."""
    gets = {
        route.resource.canonical
        for route in server.app.router.routes()
        if route.method == "GET" and route.resource is not None
    }
    assert "/flush_cache" not in gets and "/admin/policy" in gets
    posts = {
        r.resource.canonical
        for r in server.app.router.routes()
        if r.method == "POST" and r.resource is not None
    }
    assert {"/flush_cache", "/admin/policy"} <= posts


# -- bodies must be declared JSON --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/generate", {"text": "hi"}),
        ("/v1/embeddings", {"input": "hi"}),
        ("/admin/policy", {"policy": "fcfs"}),
    ],
)
async def test_a_body_without_a_json_content_type_is_415(
    http: aiohttp.ClientSession, server: RunningServer, path: str, body: dict[str, Any]
) -> None:
    import json

    data = json.dumps(body).encode()
    # what a web page's form or fetch can send cross-origin without a preflight
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        sent = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": content_type}
        async with http.post(server.base_url + path, data=data, headers=sent) as resp:
            assert resp.status == 415, (content_type, await resp.text())
            assert (await resp.json())["error"]["code"] == "unsupported_media_type"
    # no Content-Type at all (aiohttp's client would add one: sent by hand)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
        + data
    )
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 415"), answer[:300]
    assert b"unsupported_media_type" in answer


def _gzip_bomb(inflated_bytes: int) -> bytes:
    """A JSON body's gzip that inflates to ``inflated_bytes`` (about a thousand times its size)."""
    pack = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    parts = [pack.compress(b'{"prompt": "')]
    parts += [pack.compress(zeros) for _ in range(inflated_bytes >> 20)]
    return b"".join(parts) + pack.flush()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_a_compressed_body_is_415_and_its_connection_closed_unread(
    http: aiohttp.ClientSession, server: RunningServer, encoding: str
) -> None:
    """A body that inflates past the body limit is not inflated to find out: 415 at once."""
    data = _gzip_bomb(64 * 1024 * 1024)
    sent = {"Content-Type": "application/json", "Content-Encoding": encoding}
    async with http.post(server.base_url + "/v1/completions", data=data, headers=sent) as resp:
        assert resp.status == 415, await resp.text()
        assert (await resp.json())["error"]["code"] == "unsupported_media_type"
        assert resp.headers["Connection"] == "close"


@pytest.mark.parametrize("encoding", ["identity", "", " Identity "])
async def test_a_body_sent_as_it_is_may_say_so(
    http: aiohttp.ClientSession, server: RunningServer, encoding: str
) -> None:
    """``identity`` (or an empty header) is no compression: the body is read."""
    sent = {"Content-Type": "application/json", "Content-Encoding": encoding}
    body = b'{"prompt": "hi", "max_tokens": 1}'
    async with http.post(server.base_url + "/v1/completions", data=body, headers=sent) as resp:
        assert resp.status == 200, await resp.text()


async def test_a_body_refused_unread_is_skipped_not_inflated(server: RunningServer) -> None:
    """The bytes of a body refused before it is read are skipped as sent: one that does not
    inflate (not gzip at all) leaves the connection to serve the next request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    garbage = b"not gzip" * 1000
    writer.write(
        b"POST /no/such/route HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
        % len(garbage)
        + garbage
        + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 404"), answer[:300]
    assert b"HTTP/1.1 200" in answer and b'"status": "ok"' in answer.replace(b'":"', b'": "')


# -- Host and Origin on loopback ---------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"Host": "attacker.example"},  # DNS rebinding: the page's own name, pointed at us
        {"Host": "attacker.example:8000"},
        {"Host": "10.0.0.5"},
        {"Origin": "http://attacker.example"},  # a page's cross-origin request
        {"Origin": "https://127.0.0.1.attacker.example"},
        {"Origin": "null"},  # a sandboxed iframe
    ],
)
async def test_a_foreign_host_or_origin_is_403(
    http: aiohttp.ClientSession, server: RunningServer, headers: dict[str, str]
) -> None:
    for method, path, body in (
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("POST", "/flush_cache", None),
    ):
        status, answer = await _status(
            http, method, server.base_url + path, json=body, headers=headers
        )
        assert status == 403, (headers, path, answer)
        assert answer["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Host": "localhost"},
        {"Host": "localhost:1234"},
        {"Host": "127.0.0.1"},
        {"Host": "[::1]:80"},
        {"Host": "app.localhost"},
        {"Origin": "http://localhost:3000"},
        {"Origin": "http://127.0.0.1:8080"},
    ],
)
async def test_loopback_names_are_served(
    http: aiohttp.ClientSession, server: RunningServer, headers: dict[str, str]
) -> None:
    status, answer = await _status(
        http, "POST", server.base_url + "/v1/chat/completions", json=CHAT, headers=headers
    )
    assert status == 200, answer


async def test_allowed_hosts_are_served(http: aiohttp.ClientSession, server: RunningServer) -> None:
    proxied = await start_server(
        server.engine.config, engine=server.engine, allowed_host_names=["Proxy.Internal:8443"]
    )
    try:
        url = proxied.base_url + "/v1/models"
        for headers in (
            {"Host": "proxy.internal"},
            {"Origin": "https://proxy.internal"},
            {"Host": f"{socket.gethostname()}:8000"},  # this machine's own name
        ):
            assert (await _status(http, "GET", url, headers=headers))[0] == 200
        assert (await _status(http, "GET", url, headers={"Host": "other.internal"}))[0] == 403
    finally:
        await proxied.stop(stop_engine=False)


# -- no exception text to clients; client values escaped in the log -----------------------------


async def test_health_generate_returns_an_error_id_not_the_exception(
    http: aiohttp.ClientSession, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    engine = server.engine

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret detail at /srv/models/internal")

    engine.generate_choices = failing
    try:
        status, body = await _status(http, "GET", server.base_url + "/health_generate")
    finally:
        del engine.generate_choices
    message = body["error"]["message"]
    assert status == 503 and "secret" not in message and "RuntimeError" not in message
    error_id = message.split("error id ")[1].rstrip(")")
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(error_id in m and "secret detail" in m for m in logged), logged


async def test_client_values_are_escaped_in_the_log(
    http: aiohttp.ClientSession, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncengine.server")
    forged = "/v1/x%0A2030-01-01 ERROR asyncengine: forged%1B[2J"
    status, _ = await _status(http, "GET", server.base_url + forged)
    assert status == 404
    lines = [r.getMessage() for r in caplog.records if "refused GET" in r.getMessage()]
    assert lines, caplog.text
    assert all("\n" not in line and "\x1b" not in line for line in lines)
    assert any("/v1/x\\n2030-01-01 ERROR asyncengine: forged\\x1b[2J" in line for line in lines)
    # a request id goes into the engine's own log lines: printable only
    status, body = await _status(
        http, "POST", server.base_url + "/generate", json={"text": "hi", "rid": "a\nERROR b"}
    )
    assert status == 400 and body["error"]["param"] == "rid"


# -- large inputs are tokenized off the event loop ----------------------------------------------


async def test_a_large_prompt_is_tokenized_off_the_loop(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    engine = server.engine
    threads: list[str] = []
    tokenize = type(engine).tokenize

    def recording(prompt: Any, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return tokenize(engine, prompt, add_special_tokens=add_special_tokens)

    engine.tokenize = recording
    large = "word " * (LARGE_INPUT_CHARS // 5 + 10)
    try:
        for route, body in (
            ("/v1/completions", {"prompt": "small", "max_tokens": 1}),
            ("/v1/completions", {"prompt": large, "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": large}]}),
            ("/generate", {"text": large, "sampling_params": {"max_new_tokens": 1}}),
        ):
            async with http.post(server.base_url + route, json=body) as resp:
                assert resp.status in (200, 400), await resp.text()  # 400: longer than the context
    finally:
        del engine.tokenize
    loop_thread = threading.current_thread().name  # the server shares the test's loop
    assert threads[0] == loop_thread
    assert len(threads) == 4 and all(t.startswith("asyncengine-tokenize") for t in threads[1:])


@contextlib.contextmanager
def _render_threads(tokenizer: Any) -> Iterator[list[str]]:
    """The names of the threads the chat template renders on while inside."""
    threads: list[str] = []
    render = type(tokenizer).apply_chat_template

    def recording(messages: Any, *args: Any, **kwargs: Any) -> str:
        threads.append(threading.current_thread().name)
        return render(tokenizer, messages, *args, **kwargs)

    tokenizer.apply_chat_template = recording
    try:
        yield threads
    finally:
        del tokenizer.apply_chat_template


async def test_a_long_conversation_renders_off_the_loop(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    many = [*turns * (LARGE_INPUT_CHARS // 16), turns[0]]  # short turns
    with _render_threads(server.engine.tokenizer) as threads:
        for route, messages in (
            ("/v1/chat/completions", turns[:1]),
            ("/v1/chat/completions", many),
            ("/v1/messages/count_tokens", many),
        ):
            body = {"model": server.model, "messages": messages}
            if route == "/v1/chat/completions":  # count_tokens takes no max_tokens
                body["max_tokens"] = 1
            async with http.post(server.base_url + route, json=body) as resp:
                assert resp.status in (200, 400), await resp.text()  # 400: longer than the context
    assert threads[0] == threading.current_thread().name  # the server shares the test's loop
    assert len(threads) == 3 and all(t.startswith("asyncengine-tokenize") for t in threads[1:])


def _tool(name: str, description: str = "d") -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"a": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": parameters}}  # fmt: skip


async def test_a_large_request_with_short_messages_renders_off_the_loop(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    """Tools (made into a call grammar too), earlier calls' arguments, documents and template
    variables are rendered with the messages: their size, not only the messages', sends the
    rendering to the worker thread."""
    user = {"role": "user", "content": "hi"}
    large = "x" * LARGE_INPUT_CHARS
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": large}}
    bodies = [
        {"messages": [user]},
        {"messages": [user], "tools": [_tool(f"f{i}") for i in range(LARGE_INPUT_CHARS // 64)]},
        {"messages": [user], "tools": [_tool("f", large)]},
        {"messages": [user, {"role": "assistant", "tool_calls": [call]}, user]},
        {"messages": [user], "documents": [{"text": large}]},
        {"messages": [user], "chat_template_kwargs": {"context": large}},
    ]
    with _render_threads(server.engine.tokenizer) as threads:
        for body in bodies:
            body = {"model": server.model, "max_tokens": 1, **body}
            async with http.post(server.base_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status in (200, 400), await resp.text()  # 400: longer than the context
    assert threads[0] == threading.current_thread().name  # the server shares the test's loop
    assert len(threads) == len(bodies)
    assert all(t.startswith("asyncengine-tokenize") for t in threads[1:]), threads


# -- connection limit and write timeout ----------------------------------------------------------


def _stalled_stream(port: int, body: bytes) -> socket.socket:
    """A client that sends a streaming request and then reads nothing (a tiny receive window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


async def test_a_client_that_stops_reading_is_dropped_and_counted_in_the_limit(
    http: aiohttp.ClientSession, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    caplog.set_level(logging.INFO, logger="asyncengine.server")
    limited = await start_server(
        server.engine.config, engine=server.engine, max_connections=1, write_timeout=1.0
    )
    limits = limited.app[LIMITS]
    body = {
        "prompt": "tell me everything",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        "n": 16,
        "logprobs": 5,
    }
    sock = _stalled_stream(limited.port, json.dumps(body).encode())
    try:
        assert await wait_until(lambda: limits.active == 1, timeout=30)
        status, answer = await _status(
            http, "POST", limited.base_url + "/v1/chat/completions", json=CHAT
        )
        assert status == 503 and answer["error"]["code"] == "too_many_connections"
        # counted where an operator looks for refusals
        overloaded = {"endpoint": "chat_completions", "outcome": "overloaded"}
        metrics = limited.app[STATE].metrics
        assert metrics.counter_value("asyncengine_requests_total", overloaded) == 1
        # the stalled stream is dropped once its writes wait past the write timeout
        assert await wait_until(lambda: limits.active == 0, timeout=60), limits
        assert await wait_until(lambda: engine_idle(server.engine), timeout=30)
        assert "its client read nothing for 1s" in caplog.text
    finally:
        sock.close()
    status, _ = await _status(http, "POST", limited.base_url + "/v1/chat/completions", json=CHAT)
    assert status == 200
    await limited.stop(stop_engine=False)


def _stalled_body(port: int) -> socket.socket:
    """A client that sends a request's head and then none of the body it announced."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    return sock


async def test_probes_are_served_past_the_limit_and_other_requests_are_not(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    """A flood of stalled clients fills the limit: an orchestrator's liveness probe and a
    scrape still answer (a few more than the limit are kept for them), nothing else does."""
    limited = await start_server(server.engine.config, engine=server.engine, max_connections=2)
    limits = limited.app[LIMITS]
    socks = [_stalled_body(limited.port) for _ in range(2)]
    try:
        assert await wait_until(lambda: limits.active == 2, timeout=30)
        async with http.get(limited.base_url + "/health") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
        async with http.get(limited.base_url + "/metrics") as resp:
            assert resp.status == 200 and "asyncengine_" in await resp.text()
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            status, answer = await _status(http, method, limited.base_url + path, json=CHAT)
            assert status == 503 and answer["error"]["code"] == "too_many_connections"
        assert limits.active == 2
    finally:
        for sock in socks:
            sock.close()
        await limited.stop(stop_engine=False)


async def test_a_client_that_leaves_mid_body_is_an_abort_not_a_server_error(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that closes its connection halfway through its body (a cancelled request) is
    counted as an abort with one INFO line, not as a 500 with a logged traceback."""
    caplog.set_level(logging.INFO, logger="asyncengine.server")

    def counted(outcome: str) -> float:
        labels = {"endpoint": "chat_completions", "outcome": outcome}
        return server.metrics.counter_value("asyncengine_requests_total", labels)

    aborts, errors = counted("abort"), counted("error")
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"messages": '
    )
    sock.close()
    assert await wait_until(lambda: counted("abort") + counted("error") > aborts + errors)
    assert (counted("abort"), counted("error")) == (aborts + 1, errors)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    left = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
    assert len(left) == 1 and "/v1/chat/completions" in left[0], left


async def test_limits_are_validated(server: RunningServer) -> None:
    from asyncengine.server.serve import start_http

    for kwargs in ({"max_connections": 0}, {"write_timeout": 0.0}):
        with pytest.raises(ValueError):
            create_app(server.engine, **kwargs)
    with pytest.raises(ValueError, match="max_open_connections"):
        await start_http(create_app(server.engine), "127.0.0.1", 0, max_open_connections=0)


def _half_sent_head(port: int) -> socket.socket:
    """A client that sends the first ~40 bytes of a request's head and stops."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return sock


async def test_connections_past_the_open_connection_cap_are_refused_unread(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    """Connections that send a few bytes and stop fill max_open_connections (they never reach
    a handler, so max_connections does not see them): the next connection is answered 503 and
    closed, and counted (a GET /health excepted: test_probe_past_open_cap.py); once one of them
    closes, a fresh one is served."""
    from asyncengine.server.serve import start_http

    app = create_app(server.engine)
    runner, port = await start_http(app, "127.0.0.1", 0, max_open_connections=3)
    assert runner.server is not None
    held = runner.server
    base = f"http://127.0.0.1:{port}"
    socks = [_half_sent_head(port) for _ in range(3)]
    try:
        assert await wait_until(lambda: len(held.connections) == 3, timeout=30)
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            status, answer = await _status(http, method, base + path, json=CHAT)
            assert status == 503 and answer["error"]["code"] == "too_many_open_connections"
        refused = app[STATE].metrics.counter_value("asyncengine_connections_refused_total")
        assert refused == 2 and len(held.connections) == 3
        socks.pop().close()
        assert await wait_until(lambda: len(held.connections) == 2, timeout=30)
        async with http.get(base + "/health") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
    finally:
        for sock in socks:
            sock.close()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("soft", "expected"), [(1024, 768), (300, 150), (65536, 4096), (resource.RLIM_INFINITY, 4096)]
)
async def test_the_default_open_connection_cap_keeps_descriptors_spare(
    monkeypatch: pytest.MonkeyPatch, soft: int, expected: int
) -> None:
    """Below the open-files limit, with room for the process's own files, and at most 4096."""
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, resource.RLIM_INFINITY))
    assert default_max_open_connections() == expected


async def test_idle_connections_close_after_the_idle_timeout(server: RunningServer) -> None:
    from asyncengine.server.serve import start_http

    app = create_app(server.engine)
    runner, port = await start_http(app, "127.0.0.1", 0, shutdown_grace=1.0, idle_timeout=0.5)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        # the connection is kept alive, then closed by the server once idle for 0.5 s
        rest = await asyncio.wait_for(reader.read(), timeout=10)
        assert rest.endswith(b'{"status":"ok"}')
        writer.close()
    finally:
        await runner.cleanup()
