"""When a stream's headers go out: once the engine accepted the request, not at its first token
(a client or proxy waiting on headers must not time out behind a queue or a long prefill), and
not before its grammar compiled (a spec that does not compile is still a 400)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
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
