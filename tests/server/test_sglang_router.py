"""asyncengine servers as workers of SGLang's router (sglang-router): the worker endpoints it
polls, and one run of the router in front of two servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from asyncengine.common.config import EngineConfig
from tests.server_support import (
    RunningServer,
    engine_config,
    sse_json,
    start_server,
    tiny_model_dir,
    wait_until,
)

TIMEOUT = aiohttp.ClientTimeout(total=60)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return engine_config(tiny_model_dir(tmp_path_factory), kv_cache_tokens=4096)


@contextlib.asynccontextmanager
async def servers(config: EngineConfig, n: int) -> AsyncIterator[list[RunningServer]]:
    started = [await start_server(config) for _ in range(n)]
    try:
        yield started
    finally:
        for server in started:
            await server.stop()


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_worker_endpoints(config: EngineConfig) -> None:
    async with servers(config, 1) as (server,), aiohttp.ClientSession(timeout=TIMEOUT) as session:
        base = server.base_url
        info = await get_json(session, f"{base}/get_server_info")
        assert info == await get_json(session, f"{base}/server_info")
        assert info["model_path"] == config.model and info["context_length"] == 512
        assert info["max_total_num_tokens"] == 4096 and info["page_size"] == 16
        assert info["internal_states"][0]["pages_total"] == 256
        model = await get_json(session, f"{base}/get_model_info")
        assert model["served_model_name"] == server.model and model["is_generation"] is True
        assert model["vocab_size"] == 49152 and model["max_context_length"] == 512
        assert await get_json(session, f"{base}/health_generate") == {"status": "ok"}
        load = await get_json(session, f"{base}/get_load")
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

        prompt = {"input_ids": list(range(100, 164)), "sampling_params": {"max_new_tokens": 2}}
        async with session.post(f"{base}/generate", json=prompt) as resp:
            assert resp.status == 200
        assert server.engine.stats()["pages_cached"] == 4
        async with session.post(f"{base}/flush_cache") as resp:
            assert resp.status == 200
        assert server.engine.stats()["pages_cached"] == 0
        # not while a request runs: 400, and the request goes on until its client leaves
        long = {
            "input_ids": list(range(100, 164)),
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            "stream": True,
        }
        async with session.post(f"{base}/generate", json=long) as stream:
            await stream.content.readuntil(b"\n\n")
            async with session.get(f"{base}/get_load") as resp:
                assert (await resp.json())[0]["num_reqs"] == 1
            async with session.post(f"{base}/flush_cache") as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
            assert error["code"] == "engine_busy" and "no request runs" in error["message"]
            assert (await stream.content.readuntil(b"\n\n")).startswith(b"data: {")
        assert await wait_until(lambda: server.engine.stats()["running"] == 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
async def test_sglang_router_in_front_of_two_servers(config: EngineConfig) -> None:
    async with servers(config, 2) as (a, b):
        port = free_port()
        router = subprocess.Popen(
            [
                sys.executable, "-m", "sglang_router.launch_router",
                "--worker-urls", a.base_url, b.base_url,
                "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--log-level", "warn",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

                async def ready() -> bool:
                    """Both workers registered, and the model they serve known."""
                    try:
                        async with session.get(f"{base}/get_loads") as resp:
                            loads = json.loads(await resp.text()) if resp.ok else {}
                        async with session.get(f"{base}/v1/models") as resp:
                            models = json.loads(await resp.text()) if resp.ok else {}
                    except (aiohttp.ClientError, ValueError):
                        return False
                    ids = [m["id"] for m in models.get("data", [])]
                    return len(loads.get("workers", [])) == 2 and ids == [a.model]

                for _ in range(600):  # the router probes the workers, then registers them
                    if await ready():
                        break
                    await asyncio.sleep(0.1)
                assert await ready()

                for i in range(6):
                    text = f"request {i}: " + "tell me a story about the sea and its ships " * 4
                    request = {"text": text, "sampling_params": {"max_new_tokens": 3}}
                    async with session.post(f"{base}/generate", json=request) as resp:
                        assert resp.status == 200, await resp.text()
                        assert (await resp.json())["meta_info"]["completion_tokens"] == 3
                served = [s.engine.stats()["finished_length"] for s in (a, b)]
                assert served == [3, 3]

                chat = {
                    "model": a.model,
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 4,
                    "stream": True,
                }
                async with session.post(f"{base}/v1/chat/completions", json=chat) as resp:
                    assert resp.status == 200
                    chunks = sse_json(await resp.read())
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                completion = {"model": a.model, "prompt": "once upon", "max_tokens": 2}
                async with session.post(f"{base}/v1/completions", json=completion) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["usage"]["completion_tokens"] == 2

                assert all(s.engine.stats()["pages_cached"] > 0 for s in (a, b))
                async with session.post(f"{base}/flush_cache") as resp:
                    assert resp.status == 200, await resp.text()
                assert await wait_until(
                    lambda: all(s.engine.stats()["pages_cached"] == 0 for s in (a, b))
                )
        finally:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
