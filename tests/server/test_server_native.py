"""/generate (SGLang shape), raw SSE framing, client disconnects, /health and the API key."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.server.app import create_app
from asyncengine.server.serve import start_http
from tests.server_support import (
    RunningServer,
    assert_no_leak,
    engine_config,
    engine_idle,
    split_sse,
    sse_json,
    start_server,
    tiny_model_dir,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = (
    "A paged KV cache stores keys and values in fixed-size pages, so that requests sharing a "
    "prefix can share its pages and nothing is copied when a sequence grows"
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    running = await start_server(engine_config(tiny_model_dir(tmp_path_factory)))
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def post_generate(
    http: aiohttp.ClientSession, server: RunningServer, body: dict
) -> tuple[int, bytes]:
    async with http.post(server.base_url + "/generate", json=body) as resp:
        return resp.status, await resp.read()


async def test_generate_equals_engine_generate(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    expected = await server.engine.generate(
        PROMPT, SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    )
    status, raw = await post_generate(
        http,
        server,
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True},
        },
    )
    assert status == 200, raw
    body = json.loads(raw)
    assert body["text"] == expected.text
    assert body["output_ids"] == expected.token_ids
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert meta["prompt_tokens"] == expected.usage.prompt_tokens
    assert meta["completion_tokens"] == 9
    assert meta["cached_tokens"] > 0  # the engine's own run left the prefix in the cache
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)


async def test_generate_from_input_ids_and_rid(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    ids = server.engine.tokenizer.encode(PROMPT)
    params = {"max_new_tokens": 5, "temperature": 0}
    _, by_text = await post_generate(http, server, {"text": PROMPT, "sampling_params": params})
    status, by_ids = await post_generate(
        http, server, {"input_ids": ids, "sampling_params": params, "rid": "my-request-1"}
    )
    assert status == 200
    assert json.loads(by_ids)["output_ids"] == json.loads(by_text)["output_ids"]
    assert json.loads(by_ids)["meta_info"]["id"] == "my-request-1"


async def test_generate_stream_text_is_cumulative_and_ids_are_new(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    sampling = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, whole = await post_generate(http, server, {"text": PROMPT, "sampling_params": sampling})
    async with http.post(
        server.base_url + "/generate",
        json={"text": PROMPT, "sampling_params": sampling, "stream": True},
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    frames = sse_json(raw)
    for before, after in zip(frames, frames[1:], strict=False):
        assert after["text"].startswith(before["text"])
        assert before["meta_info"]["finish_reason"] is None
    joined = [t for frame in frames for t in frame["output_ids"]]
    assert joined == json.loads(whole)["output_ids"]
    assert [f["meta_info"]["completion_tokens"] for f in frames] == list(
        itertools.accumulate(len(f["output_ids"]) for f in frames)
    )
    assert frames[-1]["text"] == json.loads(whole)["text"]
    assert frames[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


@pytest.mark.parametrize("incremental_text", [False, True])
async def test_generate_stream_sends_each_logprob_once(
    http: aiohttp.ClientSession, server: RunningServer, incremental_text: bool
) -> None:
    """A 200-token stream with top-5 logprobs and the prompt scored: every token's id and
    logprobs are sent once over all frames (not again in each later frame), the prompt's in
    the first frame only; with incremental_streaming_output the text too, so the stream's
    bytes stay within a small multiple of the whole response's."""
    tokens, top = 200, 5
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": top,
        "logprob_start_len": 0,
    }
    _, whole_raw = await post_generate(http, server, body)
    whole = json.loads(whole_raw)
    stream_body = {**body, "stream": True, "incremental_streaming_output": incremental_text}
    async with http.post(server.base_url + "/generate", json=stream_body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    frames = sse_json(raw)
    assert len(frames) > tokens // 4  # streamed as it went, not in one frame
    metas = [f["meta_info"] for f in frames]
    ids = [t for f in frames for t in f["output_ids"]]
    token_logprobs = [e for m in metas for e in m["output_token_logprobs"]]
    top_logprobs = [e for m in metas for e in m["output_top_logprobs"]]
    assert ids == whole["output_ids"] and len(ids) == tokens
    assert [e[1] for e in token_logprobs] == ids
    assert len(top_logprobs) == tokens and all(len(e) == top for e in top_logprobs)
    scored = [i for i, m in enumerate(metas) if "input_token_logprobs" in m]
    assert scored == [0]
    prompt_scores = metas[0]["input_token_logprobs"]
    want = whole["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in prompt_scores] == [e[1] for e in want]
    assert all(
        (a[0] is None and b[0] is None) or abs(a[0] - b[0]) < 1e-4
        for a, b in zip(prompt_scores, want, strict=True)
    )
    if incremental_text:
        assert "".join(f["text"] for f in frames) == whole["text"]
        # each frame's own fields (id, counts, finish_reason: ~150 bytes) on top of the
        # whole response's content; a cumulative stream would be ~tokens / 2 times it
        assert len(raw) < 2 * len(whole_raw) + 200 * len(frames)
    else:
        assert frames[-1]["text"] == whole["text"]


async def test_stop_token_ids(http: aiohttp.ClientSession, server: RunningServer) -> None:
    sampling = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    _, raw = await post_generate(http, server, {"text": PROMPT, "sampling_params": sampling})
    ids = json.loads(raw)["output_ids"]
    stop_id = ids[len(ids) // 2]
    first = ids.index(stop_id)
    _, raw = await post_generate(
        http, server, {"text": PROMPT, "sampling_params": {**sampling, "stop_token_ids": [stop_id]}}
    )
    body = json.loads(raw)
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert body["output_ids"] == ids[: first + 1]


async def test_generate_logprobs(http: aiohttp.ClientSession, server: RunningServer) -> None:
    status, raw = await post_generate(
        http,
        server,
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    )
    assert status == 200
    meta = json.loads(raw)["meta_info"]
    output_ids = json.loads(raw)["output_ids"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == output_ids
    assert all(
        entry[0] <= 0 and isinstance(entry[2], str) for entry in meta["output_token_logprobs"]
    )
    assert [len(top) for top in meta["output_top_logprobs"]] == [2, 2, 2]


async def test_openai_sse_framing(http: aiohttp.ClientSession, server: RunningServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    async with http.post(server.base_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["Cache-Control"] == "no-cache"
        raw = await resp.read()
    payloads = split_sse(raw)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
async def test_disconnect_mid_stream_aborts_and_frees_pages(
    server: RunningServer, path: str
) -> None:
    engine = server.engine
    aborted_before = engine.stats()["finished_abort"]
    if path == "/generate":
        body = {
            "text": PROMPT,
            "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        }
    else:
        body = {"prompt": PROMPT, "stream": True, "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(server.base_url + path, json=body)
        assert resp.status == 200
        received = b""
        while received.count(b"\n\n") < 3:
            received += await asyncio.wait_for(resp.content.readany(), 30)
        assert engine.stats()["running"] == 1
        assert engine.stats()["pages_used"] > 0
        resp.close()  # drop the connection mid-stream
    assert await wait_until(lambda: engine_idle(engine))
    assert engine.stats()["finished_abort"] == aborted_before + 1
    assert_no_leak(engine)


async def test_disconnect_while_waiting_for_a_whole_response(server: RunningServer) -> None:
    engine = server.engine
    aborted_before = engine.stats()["finished_abort"]
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(server.base_url + "/v1/completions", json=body))
        assert await wait_until(lambda: engine.stats()["running"] == 1)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    assert await wait_until(lambda: engine_idle(engine))
    assert engine.stats()["finished_abort"] == aborted_before + 1
    assert_no_leak(engine)


async def test_health(http: aiohttp.ClientSession, server: RunningServer) -> None:
    async with http.get(server.base_url + "/health") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ok"}


async def test_health_is_503_when_the_engine_is_not_running(
    http: aiohttp.ClientSession, tmp_path_factory: pytest.TempPathFactory
) -> None:
    engine = AsyncEngine(engine_config(tiny_model_dir(tmp_path_factory)))  # never started
    runner, port = await start_http(create_app(engine), "127.0.0.1", 0)
    try:
        async with http.get(f"http://127.0.0.1:{port}/health") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "engine_stopped"
        async with http.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"}
        ) as resp:
            assert resp.status == 503
    finally:
        await runner.cleanup()


async def test_api_key(http: aiohttp.ClientSession, server: RunningServer) -> None:
    guarded = await start_server(server.engine.config, engine=server.engine, api_key="s3cret")
    try:
        url = guarded.base_url + "/v1/completions"
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 401
                error = (await resp.json())["error"]
                assert (
                    error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
                )
        async with http.post(url, json=body, headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200
        async with http.get(guarded.base_url + "/v1/models") as resp:
            assert resp.status == 401
        async with http.get(guarded.base_url + "/health") as resp:
            assert resp.status == 200  # probes need no key
    finally:
        await guarded.stop(stop_engine=False)


async def test_failed_forward_is_reported_not_hung(
    http: aiohttp.ClientSession, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    runner = server.engine.executor
    real_execute = runner.execute
    calls = 0

    def failing_after_two_steps(plan: object) -> object:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise RuntimeError("injected forward failure")
        return real_execute(plan)

    runner.execute = failing_after_two_steps
    try:
        body = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True}
        async with http.post(server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            chunks = sse_json(await resp.read())
        assert chunks[-1]["error"]["code"] == "request_failed"
        # the client gets an error id, the server's log the exception's text under that id
        message = chunks[-1]["error"]["message"]
        assert "injected" not in message and "RuntimeError" not in message
        error_id = re.search(r"error id (err-[0-9a-f]+)", message)
        assert error_id is not None, message
        logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any(error_id[1] in m and "injected forward failure" in m for m in logged), logged
        body["stream"] = False
        async with http.post(server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status == 500
            error = (await resp.json())["error"]
            assert error["type"] == "server_error" and "injected" not in error["message"]
            assert "error id err-" in error["message"]
    finally:
        runner.execute = real_execute
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)
    async with http.post(
        server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
    ) as resp:
        assert resp.status == 200
