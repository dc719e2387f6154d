"""Grammar work is bounded, over real HTTP on the tiny model: a flood of heavy regular
expressions that clients drop does not hold up a json_object request (scripts/grammar_flood.py),
the dropped requests' compiles never run, a spec over the length limit is a 400 naming it (a
schema before its keywords are walked), a compile past the time limit is a 400 saying so (and
its spec stays refused), and requests waiting for a compile count against max_waiting_requests. A grammar too slow to follow ends its
request and is refused at once from then on, one whose first mask is too slow is refused at
compile, and while a mask runs the event loop goes on serving."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch

from asyncengine.common.sampling_params import MAX_GRAMMAR_CHARS
from asyncengine.structured import grammar
from asyncengine.structured.grammar import GrammarMatcher
from tests.server_support import (
    RunningServer,
    engine_config,
    engine_idle,
    start_server,
    tiny_model_dir,
    wait_until,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "grammar_flood.py"

pytestmark = pytest.mark.asyncio(loop_scope="module")


def grammar_flood() -> Any:
    spec = importlib.util.spec_from_file_location("grammar_flood", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["grammar_flood"] = module
    spec.loader.exec_module(module)
    return module


async def started(tmp_path_factory: pytest.TempPathFactory, **overrides: Any) -> RunningServer:
    return await start_server(engine_config(tiny_model_dir(tmp_path_factory), **overrides))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    """One default server for the tests that neither change its settings nor count its
    compiles from zero (each starts and ends with the engine idle, and uses its own specs)."""
    server = await started(tmp_path_factory)
    yield server
    await server.stop()


async def post(server: RunningServer, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + "/v1/completions", json=body) as resp:
            return resp.status, await resp.json()


def counted_masks(monkeypatch: pytest.MonkeyPatch) -> list[GrammarMatcher]:
    """Every matcher's masks from here on, one entry per mask made."""
    made: list[GrammarMatcher] = []
    real = GrammarMatcher.next_bitmask

    def next_bitmask(self: GrammarMatcher) -> torch.Tensor:
        made.append(self)
        return real(self)

    monkeypatch.setattr(GrammarMatcher, "next_bitmask", next_bitmask)
    return made


class SlowSteps:
    """Stands for the ``time`` module in structured/grammar.py: each step of a matcher reads
    a second of CPU time, over ``MAX_STEP_SECONDS``."""

    def __init__(self) -> None:
        self.now = 0.0

    def thread_time(self) -> float:
        self.now += 0.5  # read at the step's start and end
        return self.now


async def test_a_json_object_request_after_a_dropped_flood_answers_quickly(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    server = await started(tmp_path_factory)
    try:
        # 20 compiles of ~0.5 s one after another held such a request for ~10 s
        result = await grammar_flood().flood(server.base_url, count=20, drop_after=0.5)
        assert result.warmup_status == 200 and result.flood_dropped == 20
        assert result.json_object_status == 200
        assert result.json_object_seconds < 5.0, result
        compiler = server.engine.held.compiler
        # the warm-up, json_object, and the flood's compiles a worker took up before the drop
        assert compiler.compiles <= 2 + 2 * 2, compiler.compiles
        assert await wait_until(lambda: engine_idle(server.engine))
    finally:
        await server.stop()


async def test_long_and_slow_grammars_are_refused(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = await started(tmp_path_factory, grammar_compile_timeout=0.3)
    try:
        status, out = await post(server, {"prompt": "x", "regex": "a" * (MAX_GRAMMAR_CHARS + 1)})
        assert status == 400 and str(MAX_GRAMMAR_CHARS) in out["error"]["message"]
        # a long schema is refused by its length before its keywords are walked (on the loop):
        # its first property's unheld keyword is never reached
        properties = {f"p{i}": {"type": "string"} for i in range(MAX_GRAMMAR_CHARS // 16)}
        properties["p0"] = {"type": "string", "uniqueItems": True}
        schema = {"type": "object", "properties": properties}
        fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": schema}}
        status, out = await post(server, {"prompt": "x", "response_format": fmt})
        assert status == 400 and out["error"]["code"] == "grammar_too_long", out
        status, out = await post(server, {"prompt": "x", "max_tokens": 2, "regex": "[0-9]"})
        assert status == 200  # the compiler started
        heavy = grammar_flood().heavy_regex(7)
        for _ in range(2):  # compiled once, then refused from the cache
            status, out = await post(server, {"prompt": "x", "max_tokens": 2, "regex": heavy})
            assert status == 400, out
            assert "took longer than 0.3 s to compile" in out["error"]["message"]
        assert server.engine.held.compiler.killed == 1
        assert await wait_until(lambda: engine_idle(server.engine))
    finally:
        await server.stop()


async def test_requests_waiting_for_a_compile_count_as_waiting(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # a compile timeout far above the heavy grammars' compile time on a busy machine
    server = await started(
        tmp_path_factory,
        max_waiting_requests=2,
        grammar_compile_workers=1,
        grammar_compile_timeout=120.0,
    )
    try:
        flood = grammar_flood()
        status, _ = await post(server, {"prompt": "x", "max_tokens": 2, "regex": "[0-9]"})
        assert status == 200
        slow = [
            asyncio.ensure_future(
                post(server, {"prompt": "x", "max_tokens": 2, "regex": flood.heavy_regex(i)})
            )
            for i in range(2)
        ]
        await asyncio.sleep(0.2)
        status, out = await post(server, {"prompt": "x", "max_tokens": 2})
        assert status == 503, out
        assert [s for s, _ in await asyncio.gather(*slow)] == [200, 200]
        assert await wait_until(lambda: engine_idle(server.engine))
    finally:
        await server.stop()


async def test_a_grammar_whose_steps_grow_ends_its_request(
    server: RunningServer,
) -> None:
    # compiles in under a second, then each token forced into the nested repetitions multiplies
    # the matcher's work by some tenfold (its 4th mask took 19 s): the request ends once one
    # step is over the limit, with what it has
    bomb = "(([a-z]{0,100}){0,100}){0,100}"
    (abc,) = server.engine.tokenizer.encode("abc")
    body = {"prompt": "x", "max_tokens": 4, "regex": bomb, "logit_bias": {str(abc): 100}}
    status, out = await post(server, body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"].startswith("abc")
    assert out["usage"]["completion_tokens"] < 4
    status, out = await post(server, {"prompt": "x", "max_tokens": 2, "regex": "[0-9]+"})
    assert status == 200 and out["choices"][0]["text"].isdigit()
    assert await wait_until(lambda: engine_idle(server.engine))


async def test_a_grammar_too_slow_to_follow_is_refused_at_once_the_next_time(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    masks = counted_masks(monkeypatch)
    monkeypatch.setattr(grammar, "time", SlowSteps())
    body = {"prompt": "x", "max_tokens": 4, "regex": "[a-z]+"}
    status, out = await post(server, body)
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "abort"
    assert out["usage"]["completion_tokens"] == 1  # ended at the first token's landing
    compiler = server.engine.held.compiler
    ran, compiles = len(masks), compiler.compiles
    assert ran >= 1
    for _ in range(2):
        status, out = await post(server, body)
        assert status == 400, out
        assert out["error"]["code"] == "grammar_too_complex"
        assert "regular expression is too slow to follow" in out["error"]["message"]
    assert len(masks) == ran and compiler.compiles == compiles  # no mask, no compile
    monkeypatch.undo()
    status, out = await post(server, {"prompt": "x", "max_tokens": 2, "regex": "[0-9]+"})
    assert status == 200 and out["choices"][0]["text"].isdigit()  # another spec is served
    assert await wait_until(lambda: engine_idle(server.engine))


async def test_a_grammar_whose_first_mask_is_too_slow_is_refused_at_compile(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # compiles in milliseconds, then its first mask takes over a second of CPU time (five
    # nested repetitions); it was made on the event loop as the request was queued
    nested = "(((([a-z]{0,5}){0,5}){0,5}){0,5}){0,5}"
    masks = counted_masks(monkeypatch)
    compiles = []
    for _ in range(2):  # probed once in a compile worker, then refused from the cache
        status, out = await post(server, {"prompt": "x", "max_tokens": 2, "regex": nested})
        assert status == 400, out
        assert out["error"]["code"] == "grammar_too_complex"
        assert "first token's mask took" in out["error"]["message"]
        compiles.append(server.engine.held.compiler.compiles)
    assert compiles[0] == compiles[1]
    assert masks == []  # nothing of it ran in the engine
    assert await wait_until(lambda: engine_idle(server.engine))


async def test_the_event_loop_serves_while_a_mask_is_made(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    making = threading.Event()  # the first mask has begun
    release = threading.Event()
    blocked: list[bool] = []  # whether the mask was still held when it went on
    real = GrammarMatcher.next_bitmask

    def next_bitmask(self: GrammarMatcher) -> torch.Tensor:
        if not making.is_set():
            making.set()
            # held until the test releases it; on the event loop that release never comes,
            # and the wait's end lets the test see it
            blocked.append(release.wait(timeout=30))
        return real(self)

    monkeypatch.setattr(GrammarMatcher, "next_bitmask", next_bitmask)
    try:
        body = {"prompt": "x", "max_tokens": 2, "regex": "[0-9]+"}
        constrained = asyncio.ensure_future(post(server, body))
        assert await asyncio.to_thread(making.wait, 30)
        async with aiohttp.ClientSession() as session:
            async with session.get(server.base_url + "/health") as resp:
                assert resp.status == 200
        plain = asyncio.ensure_future(post(server, {"prompt": "hello", "max_tokens": 2}))
        assert blocked == []  # /health answered while the mask was being made
        release.set()
        status, out = await constrained
        assert status == 200 and out["choices"][0]["text"].isdigit(), out
        assert blocked == [True]
        status, out = await plain
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        assert await wait_until(lambda: engine_idle(server.engine))
    finally:
        release.set()
