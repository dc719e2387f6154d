"""Pinned prefixes: the engine's pin/unpin and POST /v1/cache/pin, /v1/cache/unpin over real
HTTP (admin token, as the other admin routes), the pool's pinned share (409 past it), TTLs,
a chat's system prompt pinned as chat requests begin, pins in a salt's or an API key's cache
namespace, and the eviction policy's live swap over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from asyncengine import PinLimitError
from tests.api.test_scheduling_e2e import engine, params
from tests.server.test_server_scheduling import ADMIN, API_KEY, auth, post
from tests.server_support import (
    bos_model_dir,
    engine_config,
    engine_idle,
    start_server,
    tiny_model_dir,
    wait_until,
)

SYSTEM = "You are a careful assistant. " * 4  # 112 characters: 28 pages of 4


async def test_a_pinned_prefix_outlives_eviction_pressure_until_unpinned() -> None:
    eng = engine(num_pages=64, max_pinned_fraction=0.5)
    await eng.start()
    try:
        pin = await eng.pin(SYSTEM)  # computed first: nothing was cached
        assert pin.tokens == len(SYSTEM) // 4 * 4 and pin.pages == pin.tokens // 4
        for index in range(12):  # unrelated prompts churn the pool many times over
            await eng.generate(f"{index:03d} " + "x" * 60, params(4))
        kv = eng.scheduler.kv
        assert kv.tree.prefix_length(eng.tokenize(SYSTEM)) == pin.tokens
        assert eng.stats()["pages_pinned"] == pin.pages
        eng.unpin(pin.pin_id)
        for index in range(12):
            await eng.generate(f"{index:03d} " + "y" * 60, params(4))
        assert kv.tree.prefix_length(eng.tokenize(SYSTEM)) < pin.tokens  # evictable again
        with pytest.raises(KeyError):
            eng.unpin(pin.pin_id)
        kv.check_invariant()
    finally:
        await eng.stop()


async def test_a_pin_computes_again_what_steps_evicted_before_it_could_pin() -> None:
    """Steps run between the pin's computation and the pin (a pool short of pages evicts what
    it cached): the pin computes it again; evicted every time, it says so."""
    eng = engine(num_pages=64, max_pinned_fraction=0.5)
    await eng.start()
    try:
        kv = eng.scheduler.kv
        generate = eng.generate
        pressure = [True]  # evict everything after the next computation

        async def generate_then_evict(*args: Any, **kwargs: Any) -> Any:
            out = await generate(*args, **kwargs)
            if pressure:
                pressure.pop()
                kv.evict(kv.num_pages)
            return out

        eng.generate = generate_then_evict  # type: ignore[method-assign]
        pin = await eng.pin(SYSTEM)
        assert pin.tokens == len(SYSTEM) // 4 * 4 and not pressure
        assert kv.tree.prefix_length(eng.tokenize(SYSTEM)) == pin.tokens
        eng.unpin(pin.pin_id)
        kv.evict(kv.num_pages)
        pressure.extend([True] * 3)
        with pytest.raises(PinLimitError, match="evicted each time"):
            await eng.pin(SYSTEM)
        assert eng.stats()["pinned_prefixes"] == 0
        kv.check_invariant()
    finally:
        await eng.stop()


async def test_a_pin_past_the_pinned_share_is_refused_before_any_work() -> None:
    eng = engine(num_pages=64, max_pinned_fraction=0.25)  # 16 pages
    await eng.start()
    try:
        with pytest.raises(PinLimitError, match="of 16 pages; raise max_pinned_fraction"):
            await eng.pin(SYSTEM)  # 28 pages: more than the share, whatever is unpinned
        assert eng.stats()["prompt_tokens"] == 0  # nothing was computed for it
        first = await eng.pin(SYSTEM[:40])  # 10 pages
        with pytest.raises(PinLimitError, match="would hold 20 .* unpin first"):
            await eng.pin(SYSTEM[40:80])  # 10 more: 20 > 16
        eng.unpin(first.pin_id)
        await eng.pin(SYSTEM[40:80])
    finally:
        await eng.stop()


async def test_a_pin_ends_at_its_ttl() -> None:
    eng = engine(num_pages=64, max_pinned_fraction=0.5)
    await eng.start()
    try:
        pin = await eng.pin(SYSTEM, ttl_s=0.05)
        assert eng.stats()["pinned_prefixes"] == 1
        await asyncio.sleep(0.1)
        await eng.generate("tick", params(1))  # a step after it finds it gone too
        assert eng.stats()["pinned_prefixes"] == 0
        with pytest.raises(KeyError):
            eng.unpin(pin.pin_id)
        eng.scheduler.kv.check_invariant()
    finally:
        await eng.stop()


async def test_an_idle_engine_releases_a_pin_when_its_ttl_ends() -> None:
    eng = engine(num_pages=64, max_pinned_fraction=0.5)
    await eng.start()
    try:
        await eng.generate(SYSTEM, params(1))  # cached: the pin computes nothing
        steps = eng.scheduler.step_count
        pin = await eng.pin(SYSTEM, ttl_s=0.05)
        assert eng.stats()["pages_pinned"] == pin.pages > 0
        # no request arrives: the pin's pages are released all the same, and no step ran
        assert await wait_until(lambda: eng.stats()["pinned_prefixes"] == 0, timeout=5.0)
        assert eng.stats()["pages_pinned"] == 0
        assert eng.scheduler.step_count == steps
        with pytest.raises(KeyError):
            eng.unpin(pin.pin_id)
        eng.scheduler.kv.check_invariant()
    finally:
        await eng.stop()


async def test_pin_and_unpin_over_http_need_the_admin_token() -> None:
    eng = engine(num_pages=64, max_pinned_fraction=0.25)
    await eng.start()
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN, api_key=API_KEY)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": SYSTEM[:40], "ttl_s": 600}
            status, _ = await post(session, running, "/v1/cache/pin", body)
            assert status == 401
            status, _ = await post(session, running, "/v1/cache/pin", body, headers=auth())
            assert status == 403  # the API key does not open an admin route
            status, out = await post(session, running, "/v1/cache/pin", body, headers=auth(ADMIN))
            assert status == 200 and out["tokens"] == 40 and out["expires_in_s"] == 600
            status, out_big = await post(
                session, running, "/v1/cache/pin", {"prompt": SYSTEM}, headers=auth(ADMIN)
            )
            assert status == 409 and "max_pinned_fraction" in out_big["error"]["message"]
            status, _ = await post(
                session, running, "/v1/cache/pin", {"prompt": "ab"}, headers=auth(ADMIN)
            )
            assert status == 400  # shorter than a page
            status, no_ttl = await post(
                session, running, "/v1/cache/pin", {"prompt": SYSTEM[:40], "ttl_s": 0},
                headers=auth(ADMIN),
            )  # fmt: skip
            assert status == 400 and no_ttl["error"]["param"] == "ttl_s", no_ttl  # at fault
            unpin = {"pin_id": out["pin_id"]}
            status, _ = await post(session, running, "/v1/cache/unpin", unpin, headers=auth(ADMIN))
            assert status == 200
            status, _ = await post(session, running, "/v1/cache/unpin", unpin, headers=auth(ADMIN))
            assert status == 404
    finally:
        await running.stop()


async def test_the_eviction_policy_swaps_live_over_http_and_refuses_files() -> None:
    eng = engine(num_pages=64)
    await eng.start()
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN)
    try:
        async with aiohttp.ClientSession() as session:
            path = "/admin/eviction-policy"
            status, out = await post(session, running, path, {"policy": "lfu"}, headers=auth(ADMIN))
            assert status == 200 and out["previous"] == "lru"
            status, out = await post(
                session, running, path, {"policy": "/tmp/x.py:X"}, headers=auth(ADMIN)
            )
            assert status == 400 and "may not be swapped in live" in out["error"]["message"]
            async with session.get(running.base_url + path, headers=auth(ADMIN)) as resp:
                shown = await resp.json()
            assert shown["policy"] == "lfu" and "lru" in shown["by_rule"]
        assert eng.config.eviction_policy == "lfu"
    finally:
        await running.stop()


async def test_a_pinned_system_prompt_serves_chat_requests_in_its_keys_namespace(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = engine_config(tiny_model_dir(tmp_path_factory), page_size=4)
    keys = ["key-a", "key-b"]
    running = await start_server(config, admin_token=ADMIN, api_key=keys, cache_isolation="api-key")
    system = {"role": "system", "content": "You are a careful assistant. " * 6}
    url = running.base_url
    try:
        async with aiohttp.ClientSession() as session:
            pin_url = url + "/v1/cache/pin"
            status, out = await post_json(session, pin_url, {"messages": [system]}, ADMIN)
            assert status == 400 and out["error"]["param"] == "api_key"
            status, out = await post_json(
                session, pin_url, {"messages": [system], "api_key": "key-c"}, ADMIN
            )
            assert status == 400 and out["error"]["param"] == "api_key"
            status, pin = await post_json(
                session, pin_url, {"messages": [system], "api_key": "key-a"}, ADMIN
            )
            assert status == 200 and pin["tokens"] >= 32, pin
            chat = {
                "messages": [system, {"role": "user", "content": "Hi."}],
                "max_tokens": 2,
            }
            cached = {}
            for key in keys:
                status, out = await post_json(session, url + "/v1/chat/completions", chat, key)
                assert status == 200, out
                cached[key] = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached["key-a"] >= pin["tokens"] and cached["key-b"] == 0, cached
        engine = running.engine
        assert await wait_until(lambda: engine_idle(engine))
    finally:
        await running.stop()


async def test_a_pin_takes_a_cache_salt_and_api_key_only_under_isolation(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = engine_config(tiny_model_dir(tmp_path_factory), page_size=4)
    running = await start_server(config, admin_token=ADMIN)
    prompt = "Answer in one short paragraph, and say so when you are not sure. " * 2
    url = running.base_url
    try:
        async with aiohttp.ClientSession() as session:
            pin_url = url + "/v1/cache/pin"
            status, out = await post_json(
                session, pin_url, {"prompt": prompt, "api_key": "k"}, ADMIN
            )
            assert status == 400 and out["error"]["param"] == "api_key"
            status, out = await post_json(session, pin_url, {}, ADMIN)
            assert status == 400
            status, pin = await post_json(
                session, pin_url, {"prompt": prompt, "cache_salt": "s1"}, ADMIN
            )
            assert status == 200, pin
            for salt, hit in (("s1", pin["tokens"]), (None, 0)):
                body = {"prompt": prompt + " Go.", "max_tokens": 1, "cache_salt": salt}
                status, out = await post_json(session, url + "/v1/completions", body, None)
                assert status == 200, out
                got = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (got >= hit) if hit else got == 0, (salt, got)
        engine = running.engine
        assert await wait_until(lambda: engine_idle(engine))
    finally:
        await running.stop()


async def post_json(
    session: aiohttp.ClientSession, url: str, body: dict, key: str | None
) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_a_text_pinned_over_http_serves_the_completions_of_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """On a model whose tokenizer adds a BOS, a text is pinned as a completion's prompt is
    tokenized (its BOS first), so that completions starting with it read it from the cache;
    ``add_special_tokens: false`` pins it as given, for the requests sent so."""
    config = engine_config(bos_model_dir(tmp_path_factory), page_size=4)
    running = await start_server(config, admin_token=ADMIN)
    prompt = "Answer in one short paragraph, and say so when you are not sure. " * 2
    engine = running.engine
    tree = engine.scheduler.kv.tree
    bos_first = engine.tokenize(prompt)
    given = engine.tokenize(prompt, add_special_tokens=False)
    assert bos_first[1:] == given  # the tokenizer adds a BOS
    pin_url = running.base_url + "/v1/cache/pin"
    try:
        async with (
            aiohttp.ClientSession() as session,
            openai.AsyncOpenAI(base_url=running.base_url + "/v1", api_key="none") as client,
        ):
            status, pin = await post_json(session, pin_url, {"prompt": prompt}, ADMIN)
            assert status == 200, pin
            assert pin["tokens"] == len(bos_first) // 4 * 4
            assert tree.prefix_length(bos_first) == pin["tokens"]
            done = await client.completions.create(
                model=running.model, prompt=prompt + "Go.", max_tokens=1
            )
            assert done.usage is not None and done.usage.prompt_tokens_details is not None
            shared = _pages_shared(bos_first, engine.tokenize(prompt + "Go."))
            assert shared >= pin["tokens"] - 4 > 0
            assert done.usage.prompt_tokens_details.cached_tokens >= shared

            as_given = {"prompt": prompt, "add_special_tokens": False, "cache_salt": "given"}
            status, pin = await post_json(session, pin_url, as_given, ADMIN)
            assert status == 200, pin
            assert pin["tokens"] == len(given) // 4 * 4
            done = await client.completions.create(
                model=running.model,
                prompt=prompt + "Go.",
                max_tokens=1,
                extra_body={"add_special_tokens": False, "cache_salt": "given"},
            )
            assert done.usage is not None and done.usage.prompt_tokens_details is not None
            shared = _pages_shared(given, engine.tokenize(prompt + "Go.", add_special_tokens=False))
            assert shared >= pin["tokens"] - 4 > 0
            assert done.usage.prompt_tokens_details.cached_tokens >= shared
        assert await wait_until(lambda: engine_idle(engine))
    finally:
        await running.stop()


def _pages_shared(pinned: list[int], request: list[int]) -> int:
    """The whole pages (of 4) a request's ids share with the pinned ids from the start: what it
    reads from the cache (the text's last tokens may merge with what follows it)."""
    same = 0
    while same < min(len(pinned), len(request)) and pinned[same] == request[same]:
        same += 1
    return same // 4 * 4
