"""The engines a front end can be given implement EngineClient with the same sync/async shape."""

from __future__ import annotations

import inspect

import pytest

from asyncengine.api.engine import AsyncEngine
from asyncengine.api.engine_client import EngineClient
from asyncengine.server.ray_serve.remote_engine import RemoteEngine

MEMBERS = [
    name for name in dir(EngineClient) if not name.startswith("_") and name not in ("config",)
]


@pytest.mark.parametrize("engine_class", [AsyncEngine, RemoteEngine])
@pytest.mark.parametrize("member", MEMBERS)
def test_each_engine_has_the_clients_shape(engine_class: type, member: str) -> None:
    wanted = inspect.getattr_static(EngineClient, member)
    have = inspect.getattr_static(engine_class, member, None)
    assert have is not None, f"{engine_class.__name__} has no {member}"
    assert isinstance(have, property) == isinstance(wanted, property), member
    if not isinstance(wanted, property):
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(wanted), member
        assert list(inspect.signature(have).parameters) == list(
            inspect.signature(wanted).parameters
        ), member


def test_the_members_are_checked() -> None:
    assert {"stream", "reset_prefix_cache", "intake", "abort", "stats"} <= set(MEMBERS)
