"""Calls for one replica (a cache flush) when that replica died: Ray Serve holds such a call
while the replica is gone, for ever unless it is cancelled. A flush skips a replica the
router stops listing (its replacement starts empty) instead of waiting out its timeout and
failing, and a call that gets no answer is cancelled in Ray Serve, not left queued there.
No Ray: a handle whose calls for one replica never answer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import EngineError
from asyncengine.server.ray_serve import remote_engine
from asyncengine.server.ray_serve.registry import register
from asyncengine.server.ray_serve.remote_engine import RemoteEngine

pytestmark = pytest.mark.asyncio


class Call:
    """A DeploymentResponse: answers at once, or never when its replica is dead."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.cancelled = False

    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> None:
        if not self.answers:
            await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self, dead: str) -> None:
        self.dead = dead
        self.calls: dict[str, Call] = {}

    def options(self, **_: Any) -> Handle:
        return self

    def __getattr__(self, name: str) -> Any:
        handle = self

        class Method:
            @staticmethod
            def remote(*_: Any, replica: str, **__: Any) -> Call:
                handle.calls[replica] = Call(answers=replica != handle.dead)
                return handle.calls[replica]

        return Method


class Router:
    def __init__(self, replicas: list[str]) -> None:
        self.replicas = replicas
        self.resets = 0

    def replica_ids(self) -> list[str]:
        return list(self.replicas)

    def reset_tree(self) -> None:
        self.resets += 1


async def test_a_flush_skips_a_replica_that_died(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_engine, "CONTROL_CALL_TIMEOUT_SECONDS", 60.0)
    router = Router(["alive", "dead"])
    register("gone-flush", router)
    handle = Handle(dead="dead")
    engine = RemoteEngine(EngineConfig(), handle, "gone-flush")

    async def replica_leaves() -> None:  # Ray Serve drops a dead replica from the router
        await asyncio.sleep(0.3)
        router.replicas.remove("dead")

    leaving = asyncio.create_task(replica_leaves())
    await asyncio.wait_for(engine.reset_prefix_cache(), 5.0)
    await leaving
    assert set(handle.calls) == {"alive", "dead"}
    assert handle.calls["dead"].cancelled and not handle.calls["alive"].cancelled
    assert router.resets == 1


async def test_a_replica_that_does_not_answer_fails_the_flush_and_its_call_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remote_engine, "CONTROL_CALL_TIMEOUT_SECONDS", 0.5)
    register("silent-flush", Router(["alive", "silent"]))
    handle = Handle(dead="silent")
    engine = RemoteEngine(EngineConfig(), handle, "silent-flush")
    with pytest.raises(EngineError, match="replica silent did not flush its cache: no answer"):
        await asyncio.wait_for(engine.reset_prefix_cache(), 5.0)
    assert handle.calls["silent"].cancelled
