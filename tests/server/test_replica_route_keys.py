"""What the replicas' router is given: the prompt's ids as the replica's prefix cache keys them,
so that under ``cache_salt`` or cache isolation by API key one tenant's prompt never matches the
pages another tenant's identical prompt left on a replica (no Ray: a recording handle whose
replica refuses every request)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncengine.common.cache_salt import salted_ids
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.routing import ReplicaState, make_router
from asyncengine.server.app import create_app
from asyncengine.server.ray_serve.remote_engine import RemoteEngine
from asyncengine.server.serve import start_http
from tests.server_support import engine_config, tiny_model_dir

PROMPT = list(range(100, 164))  # four pages
INFO = {"max_model_len": 1024, "vocab_size": 49152}


class Call:
    """A replica call's answer: awaited (generate) or iterated (stream)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def __await__(self) -> Any:
        return self._value().__await__()

    async def _value(self) -> Any:
        return self.answer

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        return self.answer

    def cancel(self) -> None:
        pass


class Method:
    def __init__(self, handle: RecordingHandle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, *args: Any, **kwargs: Any) -> Call:
        if self.name == "info":
            return Call(INFO)
        params: SamplingParams = args[1]
        self.handle.routed.append((params.cache_salt, kwargs["route_ids"]))
        self.handle.loras.append(params.lora)
        return Call(InvalidRequestError("refused by the test's replica"))


class RecordingHandle:
    """A deployment handle that records each request's salt and route ids."""

    def __init__(self) -> None:
        self.routed: list[tuple[str | None, list[int]]] = []
        self.loras: list[str | None] = []

    def options(self, **_: Any) -> RecordingHandle:
        return self

    def __getattr__(self, name: str) -> Method:
        return Method(self, name)


async def test_each_api_key_routes_on_its_own_cache_keys(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    handle = RecordingHandle()
    engine = await RemoteEngine(
        engine_config(tiny_model_dir(tmp_path_factory)), handle, "t"
    ).start()
    app = create_app(engine, api_key=["key-a", "key-b"], cache_isolation="api-key")
    runner, port = await start_http(app, "127.0.0.1", 0, shutdown_grace=1.0)
    try:
        async with aiohttp.ClientSession() as session:
            for key, stream in (("key-a", False), ("key-b", False), ("key-a", True)):
                async with session.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 1, "stream": stream},
                    headers={"Authorization": f"Bearer {key}"},
                ) as resp:
                    assert resp.status == 400, await resp.text()
    finally:
        await runner.cleanup()
        await engine.stop()
    (salt_a, ids_a), (salt_b, ids_b), streamed = handle.routed
    assert salt_a is not None and salt_b is not None and salt_a != salt_b
    assert ids_a == salted_ids(PROMPT, salt_a) and ids_b == salted_ids(PROMPT, salt_b)
    assert streamed == (salt_a, ids_a)
    router = make_router("cache-aware")
    replicas = [ReplicaState("r0", 0, None), ReplicaState("r1", 0, None)]
    assert router.route(ids_a, replicas, 0.0).reason == "least_cached"
    assert router.route(ids_b, replicas, 0.0).reason == "least_cached"
    assert router.route(ids_a, replicas, 0.0).reason == "prefix"


async def test_the_model_field_names_an_adapter_of_the_replicas(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The replicas' config's adapters are models of the app: listed with their parent, and a
    request naming one reaches a replica under it, routed on its own cache keys; a hot load,
    which would reach one replica only, is a 501."""
    handle = RecordingHandle()
    config = engine_config(tiny_model_dir(tmp_path_factory), loras={"mine": str(tmp_path)})
    engine = await RemoteEngine(config, handle, "t").start()
    app = create_app(engine, admin_token="admin")
    runner, port = await start_http(app, "127.0.0.1", 0, shutdown_grace=1.0)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/v1/models") as resp:
                cards = {c["id"]: c for c in (await resp.json())["data"]}
            assert cards["mine"]["parent"] == engine.model_name
            for route, body in (
                ("/v1/completions", {"model": "mine", "prompt": PROMPT, "max_tokens": 1}),
                ("/v1/chat/completions", {"model": "mine", "max_tokens": 1,
                                          "messages": [{"role": "user", "content": "Hi"}]}),
            ):  # fmt: skip
                async with session.post(url + route, json=body) as resp:
                    assert resp.status == 400, await resp.text()  # the test replica refuses
            for path, body in (
                ("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(tmp_path)}),
                ("/v1/unload_lora_adapter", {"lora_name": "mine"}),
            ):  # as the other live changes the replicas refuse: a 501 that names the way
                async with session.post(
                    url + path, json=body, headers={"Authorization": "Bearer admin"}
                ) as resp:
                    assert resp.status == 501, await resp.text()
                    error = (await resp.json())["error"]
                assert error["type"] == "not_implemented"
                assert "--lora" in error["message"]
    finally:
        await runner.cleanup()
        await engine.stop()
    assert handle.loras == ["mine", "mine"]
    assert handle.routed[0] == (None, salted_ids(PROMPT, None, "mine"))
