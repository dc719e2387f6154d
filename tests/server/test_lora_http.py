"""LoRA adapters over real HTTP: the OpenAI ``model`` field and ``lora`` on /generate select an
adapter (its output is HF + PEFT's), /v1/models lists adapters with their parent, an unknown
adapter is a 404 like an unknown model, and /v1/load_lora_adapter and /v1/unload_lora_adapter
(vLLM's shape) load and unload while serving, with the admin token alone (an API key holder may
neither name the server's directories nor unload another client's adapter); a refused load is a
400; an adapter whose files are gone when it must be read back is a 404 for its own requests
alone."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from tests.executor.lora_support import PeftOracle, write_adapters
from tests.server_support import engine_config, start_server, tiny_model_dir, wait_until

KEY = "sk-lora-test"
ADMIN = "lora-admin"
PROMPT = [1, *range(300, 330)]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_adapters(model_dir, tmp_path_factory.mktemp("http_loras"))


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str | None = KEY
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.post(url, json=body, headers=headers) as resp:
        text = await resp.text()
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, text


@pytest.mark.asyncio
async def test_adapters_over_http(model_dir: Path, adapters: dict[str, Path]) -> None:
    oracle = PeftOracle(model_dir, {"r4": adapters["r4"], "r8": adapters["r8"]})
    config = engine_config(model_dir, loras={"r4": str(adapters["r4"])}, max_lora_rank=8)
    server = await start_server(config, api_key=KEY, admin_token=ADMIN)
    base = server.model
    url = server.base_url
    try:
        async with aiohttp.ClientSession() as session:
            # listed with their parent
            headers = {"Authorization": f"Bearer {KEY}"}
            async with session.get(url + "/v1/models", headers=headers) as resp:
                cards = {c["id"]: c for c in (await resp.json())["data"]}
            assert cards["r4"]["parent"] == base and "parent" not in cards[base]

            async def complete(model: str) -> tuple[int, Any]:
                body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                        "temperature": 0}  # fmt: skip
                return await _post(session, url + "/v1/completions", body)

            async def token_ids(
                model: str | None, route: str = "/generate", key: str = "lora"
            ) -> list[int]:
                body: dict[str, Any] = {
                    "input_ids": PROMPT,
                    "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                        "ignore_eos": True},
                }  # fmt: skip
                if model is not None:
                    body[key] = model
                status, out = await _post(session, url + route, body)
                assert status == 200, out
                return list(out["output_ids"])

            assert await token_ids("r4") == oracle.greedy("r4", PROMPT, NEW_TOKENS)
            assert await token_ids("r4", key="lora_path") == await token_ids("r4")  # SGLang's
            assert await token_ids(None) == oracle.greedy(None, PROMPT, NEW_TOKENS)
            # an adapter's embedding is its hidden states' (HF + PEFT)
            for model, lora in ((base, None), ("r4", "r4")):
                body = {"model": model, "input": PROMPT, "encoding_format": "float"}
                status, out = await _post(session, url + "/v1/embeddings", body)
                assert status == 200, out
                vector = torch.tensor(out["data"][0]["embedding"], dtype=torch.float64)
                reference = oracle.embedding(lora, PROMPT)
                assert (vector - reference).abs().max() < 1e-4, lora
            assert (oracle.embedding("r4", PROMPT) - oracle.embedding(None, PROMPT)).norm() > 1e-2
            status, by_model = await complete("r4")
            assert status == 200 and by_model["model"] == "r4"
            status, by_base = await complete(base)
            assert status == 200 and by_model["choices"][0]["text"] != by_base["choices"][0]["text"]
            # an unknown adapter is a 404 like an unknown model, on both routes
            status, err = await complete("r8")
            assert status == 404 and err["error"]["code"] == "model_not_found"
            status, err = await _post(
                session, url + "/generate", {"input_ids": PROMPT, "lora": "r8"}
            )
            assert status == 404 and err["error"]["code"] == "model_not_found"

            load = url + "/v1/load_lora_adapter"
            unload = url + "/v1/unload_lora_adapter"
            # the admin token's: the API key opens neither
            r8 = {"lora_name": "r8", "lora_path": str(adapters["r8"])}
            status, _ = await _post(session, load, r8, None)
            assert status == 401
            status, err = await _post(session, load, r8)
            assert status == 403 and err["error"]["code"] == "invalid_admin_token"
            assert "r8" not in server.engine.lora_adapters
            status, err = await _post(session, unload, {"lora_name": "r4"})
            assert status == 403 and err["error"]["code"] == "invalid_admin_token"
            status, _ = await complete("r4")
            assert status == 200  # still served
            # refused loads: 400, nothing changes
            status, err = await _post(
                session, load, {"lora_name": "r16", "lora_path": str(adapters["r16"])}, ADMIN
            )
            assert status == 400 and "rank 16, over the limit of 8" in err["error"]["message"]
            assert err["error"]["code"] == "invalid_request"
            status, err = await _post(
                session, load, {"lora_name": "x", "lora_path": str(model_dir)}, ADMIN
            )
            assert status == 400 and "not a PEFT adapter" in err["error"]["message"]
            assert err["error"]["code"] == "invalid_request"
            status, err = await _post(session, load, {"lora_name": "r8"}, ADMIN)
            assert status == 400
            status, err = await _post(  # the base's served name: the model field selects the base
                session, load, {"lora_name": base, "lora_path": str(adapters["r8"])}, ADMIN
            )
            assert status == 400 and err["error"]["param"] == "lora_name"
            assert err["error"]["code"] == "invalid_request"
            assert "is a name the base model is served under" in err["error"]["message"]
            assert "r16" not in server.engine.lora_adapters
            # a hot load, then the adapter serves
            status, text = await _post(
                session, load, {"lora_name": "r8", "lora_path": str(adapters["r8"])}, ADMIN
            )
            assert status == 200, text
            assert await token_ids("r8") == oracle.greedy("r8", PROMPT, NEW_TOKENS)
            status, _ = await complete("r8")
            assert status == 200
            status, text = await _post(session, unload, {"lora_name": "r8"}, ADMIN)
            assert status == 200, text
            status, _ = await complete("r8")
            assert status == 404
            status, err = await _post(session, unload, {"lora_name": "r8"}, ADMIN)
            assert status == 404
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_an_adapter_whose_directory_is_gone_is_a_404_for_its_requests_alone(
    model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """max_cpu_loras 1 keeps one of the two adapters in memory; the other's directory is deleted.
    Requests for it, sent together with the base's and the other adapter's while a long base
    request runs, get a 404 naming it; all the others finish with HF + PEFT's tokens."""
    oracle = PeftOracle(model_dir, {"r8": adapters["r8"]})
    gone = tmp_path / "gone"
    shutil.copytree(adapters["r4"], gone)
    loras = {"gone": str(gone), "r8": str(adapters["r8"])}  # r8, loaded last, stays in memory
    config = engine_config(model_dir, loras=loras, max_cpu_loras=1, enable_prefix_cache=False)
    server = await start_server(config, api_key=KEY, admin_token=ADMIN)
    url = server.base_url
    try:
        assert server.engine.executor.loras.loaded == ["r8"]
        shutil.rmtree(gone)
        async with aiohttp.ClientSession() as session:

            def generate(lora: str | None, max_new_tokens: int = NEW_TOKENS) -> Any:
                body: dict[str, Any] = {
                    "input_ids": PROMPT,
                    "lora": lora,
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                        "ignore_eos": True},
                }  # fmt: skip
                return _post(session, url + "/generate", body)

            completion = {"model": "gone", "prompt": PROMPT, "max_tokens": NEW_TOKENS}
            streamed = {**completion, "stream": True}
            long = asyncio.create_task(generate(None, 48))
            await wait_until(lambda: bool(server.engine.scheduler.running))
            results = await asyncio.gather(
                generate("gone"),
                generate(None),
                generate("r8"),
                _post(session, url + "/v1/completions", completion),
                generate("gone"),
                _post(session, url + "/v1/completions", streamed),  # refused before its headers
            )
            for status, err in (results[0], results[3], results[4], results[5]):
                assert status == 404, err
                assert err["error"]["code"] == "adapter_unavailable"
                assert "'gone' is unavailable" in err["error"]["message"]
                assert str(tmp_path) not in err["error"]["message"]
            for (status, out), lora in ((results[1], None), (results[2], "r8")):
                assert status == 200, out
                assert out["output_ids"] == oracle.greedy(lora, PROMPT, NEW_TOKENS), lora
            status, out = await long
            assert status == 200 and len(out["output_ids"]) == 48
            assert out["output_ids"][:NEW_TOKENS] == oracle.greedy(None, PROMPT, NEW_TOKENS)
            # later requests for it are refused the same way, until it is unloaded
            status, err = await generate("gone")
            assert status == 404 and err["error"]["code"] == "adapter_unavailable"
            unload = url + "/v1/unload_lora_adapter"
            status, text = await _post(session, unload, {"lora_name": "gone"}, ADMIN)
            assert status == 200, text
            status, err = await generate("gone")
            assert status == 404 and err["error"]["code"] == "model_not_found"
            assert server.engine.lora_adapters == {"r8": str(adapters["r8"])}
    finally:
        await server.stop()


@pytest.mark.asyncio
async def test_without_an_admin_token_no_client_loads_an_adapter(
    model_dir: Path, adapters: dict[str, Path]
) -> None:
    server = await start_server(engine_config(model_dir), api_key=KEY)
    try:
        async with aiohttp.ClientSession() as session:
            for route, body in (
                ("/v1/load_lora_adapter", {"lora_name": "r8", "lora_path": str(adapters["r8"])}),
                ("/v1/unload_lora_adapter", {"lora_name": "r8"}),
            ):
                status, err = await _post(session, server.base_url + route, body)
                assert status == 403 and err["error"]["code"] == "needs_admin_token", err
            assert "r8" not in server.engine.lora_adapters
    finally:
        await server.stop()


def test_an_adapter_named_as_the_base_model_is_refused_at_start(
    model_dir: Path, adapters: dict[str, Path]
) -> None:
    """The ``model`` field naming it would reach the base: the server does not start, as a hot
    load of that name is refused."""
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.server.app import create_app

    engine = AsyncEngine(engine_config(model_dir, loras={"tiny": str(adapters["r4"])}))
    with pytest.raises(ValueError, match="LoRA adapter 'tiny' has a name the base model is served"):
        create_app(engine, served_model_names=["base", "tiny"])
    create_app(engine, served_model_names=["base"])
