"""/server_info under ``--replicas``: SGLang's figures with SGLang's meaning under data
parallelism, one rank (replica) each: the pool and the running cap are one replica's,
``dp_size`` counts the replicas and ``internal_states`` holds one entry per replica. No Ray:
a RemoteEngine whose router reports two replicas' stats. /get_load answers one entry per replica,
in the same order."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from asyncengine.common.config import EngineConfig
from asyncengine.server.ray_serve.registry import register
from asyncengine.server.ray_serve.remote_engine import RemoteEngine
from asyncengine.server.sglang_worker import get_load, server_info
from asyncengine.server.state import STATE

pytestmark = pytest.mark.asyncio

REPLICA = {"pages_total": 256, "pages_free": 250, "running": 1, "waiting": 0}


class Router:
    def __init__(self, stats: dict[str, dict[str, Any]]) -> None:
        self.stats = stats

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        return {replica: dict(stats) for replica, stats in self.stats.items()}


async def info_of(app_name: str, stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    register(app_name, Router(stats))
    config = EngineConfig(page_size=16, max_running_requests=8)
    engine = RemoteEngine(config, SimpleNamespace(options=lambda **_: None), app_name)
    engine._info = {"max_model_len": 512, "vocab_size": 100}
    app = web.Application()
    app[STATE] = SimpleNamespace(engine=engine, model_name="m", cache_isolation="shared")  # type: ignore[misc]
    response = await server_info(make_mocked_request("GET", "/server_info", app=app))
    assert isinstance(response, web.Response) and response.body is not None
    body: dict[str, Any] = json.loads(bytes(response.body))  # type: ignore[arg-type]
    return body


async def test_each_figure_is_one_replicas_and_dp_size_counts_them() -> None:
    info = await info_of("info-two", {"b": {**REPLICA, "running": 2}, "a": REPLICA})
    assert info["max_total_num_tokens"] == 256 * 16  # one replica's pool, not the sum
    assert info["max_running_requests"] == 8
    assert info["dp_size"] == 2
    assert [s["running"] for s in info["internal_states"]] == [1, 2]  # by replica id


async def test_before_any_replica_reported() -> None:
    info = await info_of("info-none", {})
    assert (info["max_total_num_tokens"], info["dp_size"]) == (0, 1)
    assert info["internal_states"] == [{}]


async def load_of(app_name: str, stats: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    register(app_name, Router(stats))
    config = EngineConfig(page_size=16, max_running_requests=8)
    engine = RemoteEngine(config, SimpleNamespace(options=lambda **_: None), app_name)
    app = web.Application()
    app[STATE] = SimpleNamespace(engine=engine, model_name="m", cache_isolation="shared")  # type: ignore[misc]
    response = await get_load(make_mocked_request("GET", "/get_load", app=app))
    assert isinstance(response, web.Response) and response.body is not None
    body: list[dict[str, Any]] = json.loads(bytes(response.body))  # type: ignore[arg-type]
    return body


async def test_get_load_has_one_entry_per_replica_in_replica_id_order() -> None:
    stats = {
        "b": {**REPLICA, "running": 2, "waiting": 3, "pages_free": 240},
        "a": REPLICA,
    }
    loads = await load_of("load-two", stats)
    info = await info_of("load-two-info", stats)
    assert len(loads) == info["dp_size"] == 2
    assert [load["dp_rank"] for load in loads] == [0, 1]
    # the same order as internal_states: replica "a" first
    assert [load["num_reqs"] for load in loads] == [
        s["running"] + s["waiting"] for s in info["internal_states"]
    ]
    assert loads[0] == {"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 6 * 16}
    assert loads[1] == {"dp_rank": 1, "num_reqs": 5, "num_waiting_reqs": 3, "num_tokens": 16 * 16}


async def test_get_load_before_any_replica_reported_is_one_idle_rank() -> None:
    loads = await load_of("load-none", {})
    assert loads == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
