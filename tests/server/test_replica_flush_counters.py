"""A flush of replicas' prefix caches with ``reset_counters`` reaches each replica's engine, as
one engine's reset does (compare_policies --real resets counters after its warm-up)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.server.ray_serve.remote_engine import RemoteEngine
from asyncengine.server.ray_serve.replica import EngineReplica

pytestmark = pytest.mark.asyncio


class _Call:
    def __init__(self, calls: list[dict[str, Any]]) -> None:
        self.calls = calls

    def remote(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)

        async def done() -> None:
            return None

        return done()


class _Handle:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.flush_cache = _Call(self.calls)

    def options(self, **_: Any) -> _Handle:
        return self


class _Router:
    def __init__(self) -> None:
        self.reset = False

    def replica_ids(self) -> list[str]:
        return ["r0", "r1"]

    def reset_tree(self) -> None:
        self.reset = True


class _Engine:
    def __init__(self) -> None:
        self.resets: list[bool] = []

    async def reset_prefix_cache(self, reset_counters: bool = False) -> None:
        self.resets.append(reset_counters)


@pytest.mark.parametrize("reset_counters", [False, True])
async def test_the_flag_reaches_every_replica(
    monkeypatch: pytest.MonkeyPatch, reset_counters: bool
) -> None:
    handle, router = _Handle(), _Router()
    remote = RemoteEngine(cast(EngineConfig, None), handle, "app")
    monkeypatch.setattr(remote, "router", lambda: router)
    await remote.reset_prefix_cache(reset_counters=reset_counters)
    assert handle.calls == [{"replica": r, "reset_counters": reset_counters} for r in ("r0", "r1")]
    assert router.reset


@pytest.mark.parametrize("reset_counters", [False, True])
async def test_a_replica_hands_the_flag_to_its_engine(reset_counters: bool) -> None:
    engine = _Engine()
    replica = cast(EngineReplica, SimpleNamespace(engine=engine))  # no Ray: the method alone
    await EngineReplica.flush_cache(replica, replica="r0", reset_counters=reset_counters)
    assert engine.resets == [reset_counters]
