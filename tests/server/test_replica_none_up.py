"""Requests while no replica is up (all died, none restarted yet): Ray Serve holds such a
request with no bound; the serving side fails it with a 503 and Retry-After once no replica has
been up for ``NO_REPLICA_WAIT_SECONDS``, and cancels it in Ray Serve. A request waits on while
some replica is up (that replica answers or fails it). No Ray: a handle whose calls answer
when told to, and a router that lists the replicas up."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import EngineUnavailableError
from asyncengine.common.outputs import GenerateOutput
from asyncengine.server.errors import UNAVAILABLE_RETRY_AFTER_SECONDS, from_engine_error
from asyncengine.server.ray_serve import remote_engine
from asyncengine.server.ray_serve.registry import register
from asyncengine.server.ray_serve.remote_engine import RemoteEngine

pytestmark = pytest.mark.asyncio


class Call:
    """A DeploymentResponse (awaited) or DeploymentResponseGenerator (iterated) that answers
    once ``answer`` is set."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.cancelled = False

    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> str:
        await self.answer.wait()
        return "answered"

    async def __anext__(self) -> None:
        await self.answer.wait()  # a stream opens with None once a replica accepted it

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self) -> None:
        self.calls: list[Call] = []

    def options(self, **_: Any) -> Handle:
        return self

    def __getattr__(self, name: str) -> Any:
        handle = self

        class Method:
            @staticmethod
            def remote(*_: Any, **__: Any) -> Call:
                handle.calls.append(Call())
                return handle.calls[-1]

        return Method


class Router:
    def __init__(self, replicas: list[str]) -> None:
        self.replicas = replicas

    def replica_ids(self) -> list[str]:
        return list(self.replicas)


def engine_for(app: str, replicas: list[str]) -> tuple[RemoteEngine, Handle]:
    register(app, Router(replicas))
    handle = Handle()
    engine = RemoteEngine(EngineConfig(), handle, app)
    engine._running = True
    return engine, handle


@pytest.fixture(autouse=True)
def short_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_engine, "NO_REPLICA_WAIT_SECONDS", 0.3)
    monkeypatch.setattr(remote_engine, "NO_REPLICA_POLL_SECONDS", 0.02)


async def test_a_request_fails_with_a_503_once_no_replica_has_been_up_for_the_bound() -> None:
    engine, handle = engine_for("none-up-generate", [])
    with pytest.raises(EngineUnavailableError, match="no replica has been up") as raised:
        await asyncio.wait_for(engine.generate([1, 2, 3], request_id="r1"), 5.0)
    (call,) = handle.calls
    assert call.cancelled and not engine._calls  # cancelled in Ray Serve, not left queued
    refused = from_engine_error(raised.value)
    assert refused.status == 503 and refused.code == "engine_unavailable"
    assert refused.headers == {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)}


async def test_a_stream_is_refused_before_its_headers_once_no_replica_has_been_up() -> None:
    engine, handle = engine_for("none-up-stream", [])
    stream = engine.stream([1, 2, 3], request_id="s1")
    with pytest.raises(EngineUnavailableError):
        await asyncio.wait_for(stream.accepted(), 5.0)
    (call,) = handle.calls
    assert call.cancelled and not engine._calls


async def test_a_request_waits_on_while_a_replica_is_up_or_comes_back() -> None:
    engine, handle = engine_for("one-up", ["r0"])
    router = Router(["r0"])
    register("one-up", router)
    waiting = asyncio.create_task(engine.generate([1, 2, 3], request_id="w1"))
    await asyncio.sleep(0.5)  # past the bound, but a replica is up: it holds the request
    assert not waiting.done()
    router.replicas.clear()  # every replica died; one comes back within the bound
    await asyncio.sleep(0.2)
    router.replicas.append("r1")
    await asyncio.sleep(0.3)
    assert not waiting.done()
    handle.calls[0].answer.set()
    output: GenerateOutput | str = await asyncio.wait_for(waiting, 5.0)
    assert output == "answered" and not handle.calls[0].cancelled
