"""GET /openapi.json: every route, bodies from the msgspec types the handlers decode with; and a
short fuzz run driven by it (scripts/fuzz_api.py runs the long one): no 5xx, every 4xx a JSON
error, the server serving normally afterwards with no KV page leaked."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import jsonschema
import msgspec
import pytest
import requests

from asyncengine.server.openai_schema import ChatCompletionRequest
from asyncengine.server.openapi import REQUEST_BODIES
from tests.openai_server import server  # noqa: F401  (fixture)
from tests.scripts.test_bench_scripts import load_script
from tests.server_support import RunningServer, engine_config, start_server, tiny_model_dir


def _fuzz_script() -> ModuleType:
    return load_script("fuzz_api")


async def _document(server: RunningServer) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(server.base_url + "/openapi.json") as response:
            assert response.status == 200
            assert response.content_type == "application/json"
            return dict(await response.json())


@pytest.mark.asyncio(loop_scope="module")
async def test_the_document_lists_every_route_with_its_body(server: RunningServer) -> None:
    document = await _document(server)
    assert document["openapi"].startswith("3.1")
    routes = {
        (route.method.lower(), route.resource.canonical)
        for route in server.app.router.routes()
        if route.method not in {"HEAD", "OPTIONS"} and route.resource is not None
    }
    listed = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert listed == routes
    for path, body_type in REQUEST_BODIES.items():
        if path not in document["paths"]:
            continue  # the admin routes exist only with an admin token
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{body_type.__name__}"}
    assert document["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"


# the POST routes that read no body
BODILESS = frozenset({"/flush_cache"})


def test_every_post_route_that_reads_a_body_documents_it() -> None:
    """The admin routes too (the fuzzer generates bodies only from the document)."""
    from asyncengine.server.app import create_app
    from tests.api.test_engine_loop import fake_engine

    app = create_app(fake_engine(), api_key="k", admin_token="adm")
    posts = {
        route.resource.canonical
        for route in app.router.routes()
        if route.method == "POST" and route.resource is not None
    }
    assert posts - BODILESS == set(REQUEST_BODIES)


@pytest.mark.asyncio(loop_scope="module")
async def test_the_document_is_open_while_the_api_needs_the_key(server: RunningServer) -> None:
    """As vLLM serves it: the document holds no data, and clients read it before any key."""
    import aiohttp

    guarded = await start_server(server.engine.config, engine=server.engine, api_key="s3cret")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(guarded.base_url + "/openapi.json") as response:
                assert response.status == 200
                assert "/v1/embeddings" in (await response.json())["paths"]
            async with session.get(guarded.base_url + "/v1/models") as response:
                assert response.status == 401
    finally:
        await guarded.stop(stop_engine=False)


@pytest.mark.asyncio(loop_scope="module")
async def test_the_body_schemas_are_the_validators_own(server: RunningServer) -> None:
    document = await _document(server)
    components = document["components"]["schemas"]
    _, expected = msgspec.json.schema_components(
        [ChatCompletionRequest], ref_template="#/components/schemas/{name}"
    )
    for name, schema in expected.items():
        assert components[name] == schema
    # and the document agrees with the server on what a body may be
    chat = {"$ref": "#/components/schemas/ChatCompletionRequest", "components": {}}
    resolver_document = {**chat, "components": document["components"]}
    good = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    jsonschema.validate(good, resolver_document)
    msgspec.json.decode(msgspec.json.encode(good), type=ChatCompletionRequest)
    for bad in ({"messages": []}, {"messages": "hi"}, {**good, "tool_choice": "maybe"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, resolver_document)
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode(bad), type=ChatCompletionRequest)


@pytest.mark.slow
def test_a_short_fuzz_run_finds_no_server_error(tmp_path_factory: pytest.TempPathFactory) -> None:
    fuzz = _fuzz_script()
    config = engine_config(
        tiny_model_dir(tmp_path_factory),
        max_model_len=1024,
        max_new_tokens_limit=fuzz.MAX_NEW_TOKENS,
    )
    server = fuzz.BackgroundServer(config)
    base_url = server.start()
    try:
        report = fuzz.fuzz(base_url, examples=10, seed=1)
        fuzz.fuzz_tool_chats(base_url, examples=3, seed=1, report=report)
        assert report.failures == []
        assert report.requests > 90
        assert report.operations["POST /v1/chat/completions (tools)"].requests == 3
        for operation in ("POST /v1/messages", "POST /v1/responses"):  # the agent APIs too
            assert report.operations[f"{operation} (positive)"].requests == 10
        assert fuzz.serves_normally(base_url)
        assert server.call(server.leak_check()) == "ok"
        assert requests.get(base_url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()


def test_the_fuzzer_reports_each_body_that_made_the_server_log_an_error(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The long run's check: a request during which the server logs an ERROR line fails the run,
    with its body, seed and round, though it was answered 200; the same seed sends the same
    bodies."""
    import logging

    fuzz = _fuzz_script()
    config = engine_config(tiny_model_dir(tmp_path_factory), max_new_tokens_limit=4)
    server = fuzz.BackgroundServer(config)
    base_url = server.start()
    engine = server.engine
    real = engine.generate_choices

    async def logging_an_error(prompt: Any, params: Any, **kwargs: Any) -> Any:
        logging.getLogger("asyncengine.core.lifecycle").error("injected: prompt %r", prompt[:3])
        return await real(prompt, params, **kwargs)

    engine.generate_choices = logging_an_error
    log = fuzz.ErrorLines()
    logging.getLogger().addHandler(log)
    try:
        runs = []
        for _ in range(2):
            report = fuzz.FuzzReport(log=log)
            # 8 bodies an operation: a few of the valid ones are answered 200 (most ask past the
            # limit of 4 new tokens)
            fuzz.fuzz(base_url, 8, seed=2, paths=("/v1/completions",), report=report)
            runs.append(report)
        timed = fuzz.fuzz_for(base_url, 3.0, 50, seed=2, paths=("/v1/completions",))
        assert 1 <= timed.rounds < 50  # stopped by its 3 s, not by its rounds
    finally:
        logging.getLogger().removeHandler(log)
        server.stop()
    report = runs[0]
    assert set(report.operations) == {
        "POST /v1/completions (positive)",
        "POST /v1/completions (negative)",
    }
    answered = [f for f in report.failures if f["status"] == 200]
    assert answered and report.error_lines >= len(answered)
    for finding in answered:
        assert "server ERROR line" in finding["problem"] and finding["seed"] == 2
        assert "injected: prompt" in finding["server_errors"][0]
        assert json.loads(finding["body"])  # the body as sent, to replay
    assert [f["body"] for f in runs[1].failures] == [f["body"] for f in report.failures]
