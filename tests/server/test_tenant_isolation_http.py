"""The prefix cache is no oracle across clients, over real HTTP: two cache salts share nothing
(the second salt's prompt is computed again, cached_tokens 0), the same salt hits; a bad salt
is a 400; ``cache_isolation = "api-key"`` gives each key its own namespace; cached_tokens can be
left out of responses; /metrics without the key leaves out hit counters and tenant labels. The
KV invariant is checked after every step (CheckedEngine)."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import aiohttp
import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.server.app import create_app
from asyncengine.server.scheduling_metrics import tenant_label
from asyncengine.server.tenancy import key_tenant
from tests.api.test_engine_loop import CharTokenizer, CheckedEngine, fake_engine
from tests.fake_executor import FakeExecutor
from tests.server_support import (
    RunningServer,
    assert_no_leak,
    engine_idle,
    start_server,
    wait_until,
)

PROMPT = "the same long system prompt, page after page of it"  # 50 characters: 50 tokens


async def started(**app_kwargs: Any) -> RunningServer:
    engine = fake_engine(num_pages=256)
    await engine.start()
    return await start_server(engine.config, engine=engine, **app_kwargs)


async def complete(
    session: aiohttp.ClientSession, server: RunningServer, key: str | None = None, **extra: Any
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    async with session.post(
        server.base_url + "/v1/completions", json=body, headers=headers
    ) as resp:
        return resp.status, await resp.json()


def cached(out: Any) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_two_salts_share_nothing_over_http() -> None:
    server = await started()
    try:
        engine = server.engine
        async with aiohttp.ClientSession() as session:
            status, first = await complete(session, server, cache_salt="alice")
            assert status == 200 and cached(first) == 0
            misses = engine.stats()["miss_tokens"]
            status, other = await complete(session, server, cache_salt="bob")
            assert status == 200 and cached(other) == 0
            assert engine.stats()["miss_tokens"] == misses + len(PROMPT)  # computed again
            status, plain = await complete(session, server)  # no salt: the shared cache
            assert status == 200 and cached(plain) == 0
            status, again = await complete(session, server, cache_salt="alice")
            assert status == 200 and cached(again) >= 48
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            async with session.post(
                server.base_url + "/generate",
                json={
                    "text": PROMPT,
                    "cache_salt": "bob",
                    "sampling_params": {"max_new_tokens": 1},
                },
            ) as resp:
                assert (
                    resp.status == 200 and (await resp.json())["meta_info"]["cached_tokens"] >= 48
                )
            chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
            for salt in ("carol", "dave"):
                async with session.post(
                    server.base_url + "/v1/chat/completions", json={**chat, "cache_salt": salt}
                ) as resp:
                    assert resp.status == 200 and cached(await resp.json()) == 0
            for bad in (7, "x" * 257, ["a"]):
                status, out = await complete(session, server, cache_salt=bad)
                assert status == 400 and "cache_salt" in out["error"]["message"], out
        assert await wait_until(lambda: engine_idle(engine))
        assert_no_leak(engine)
    finally:
        await server.stop()


async def test_each_api_key_gets_its_own_namespace() -> None:
    server = await started(api_key=["key-a", "key-b"], cache_isolation="api-key")
    try:
        async with aiohttp.ClientSession() as session:
            status, out = await complete(session, server, "key-a")
            assert status == 200 and cached(out) == 0
            status, out = await complete(session, server, "key-b")
            assert status == 200 and cached(out) == 0  # another key: nothing shared
            status, out = await complete(session, server, "key-a")
            assert status == 200 and cached(out) >= 48
            status, out = await complete(session, server, "key-a", cache_salt="own")
            assert status == 200 and cached(out) == 0  # a salt splits a key's namespace
            status, _ = await complete(session, server, "key-c")
            assert status == 401
        assert await wait_until(lambda: engine_idle(server.engine))
        assert_no_leak(server.engine)
    finally:
        await server.stop()


async def test_embeddings_keep_to_the_keys_namespace() -> None:
    """Last-token pooling reads cached pages: another key's text is computed again."""
    engine = CheckedEngine(
        EngineConfig.from_dict({"page_size": 4, "kv_cache_tokens": 1024, "log_interval": 0}),
        executor=FakeExecutor(256, pooling="last"),
        tokenizer=CharTokenizer(),
    )
    await engine.start()
    server = await start_server(
        engine.config, engine=engine, api_key=["key-a", "key-b"], cache_isolation="api-key"
    )
    try:
        async with aiohttp.ClientSession() as session:
            for key, salt, computed in [
                ("key-a", None, True),
                ("key-b", None, True),  # another key
                ("key-b", "own", True),  # a salt splits a key's namespace
                ("key-a", None, False),
                ("key-b", "own", False),
            ]:
                misses = engine.stats()["miss_tokens"]
                async with session.post(
                    server.base_url + "/v1/embeddings",
                    json={"input": PROMPT, "cache_salt": salt},
                    headers={"Authorization": f"Bearer {key}"},
                ) as resp:
                    assert resp.status == 200
                grown = engine.stats()["miss_tokens"] - misses
                assert (grown == len(PROMPT)) is computed, (key, salt, grown)
        assert await wait_until(lambda: engine_idle(engine))
        assert_no_leak(engine)
    finally:
        await server.stop()


async def test_under_isolation_only_the_admin_token_flushes_or_scrapes_the_whole_cache() -> None:
    for admin_token, statuses in ((None, (403, 403)), ("adm", (403, 200))):
        server = await started(
            api_key=["key-a", "key-b"], cache_isolation="api-key", admin_token=admin_token
        )
        try:
            async with aiohttp.ClientSession() as session:
                status, _ = await complete(session, server, "key-a")
                assert status == 200
                flush = server.base_url + "/flush_cache"
                async with session.post(flush, headers={"Authorization": "Bearer key-b"}) as r:
                    assert r.status == statuses[0]
                status, out = await complete(session, server, "key-a")
                assert status == 200 and cached(out) >= 48  # still there
                scrapes = {}
                for key in ("key-a", "adm"):
                    async with session.get(
                        server.base_url + "/metrics", headers={"Authorization": f"Bearer {key}"}
                    ) as r:
                        scrapes[key] = await r.text()
                assert "cache_hit" not in scrapes["key-a"]  # a key learns nothing of the others
                assert ("cache_hit" in scrapes["adm"]) is (admin_token is not None)
                async with session.post(flush, headers={"Authorization": "Bearer adm"}) as r:
                    assert r.status == statuses[1]
            assert await wait_until(functools.partial(engine_idle, server.engine))
        finally:
            await server.stop()


async def test_with_api_keys_only_the_admin_token_flushes_the_shared_cache() -> None:
    """Emptying the shared cache slows every tenant: with API keys no key may, whether or not
    the server has an admin token (without one, no one may: a 403 that says so)."""
    for admin_token, by_key, by_nobody in ((None, (403, 403), 403), ("adm", (401, 403), 401)):
        server = await started(api_key=["key-a", "key-b"], admin_token=admin_token)
        try:
            async with aiohttp.ClientSession() as session:
                flush = server.base_url + "/flush_cache"
                status, _ = await complete(session, server, "key-a")
                assert status == 200
                async with session.post(flush, headers={"x-api-key": "key-b"}) as r:
                    assert r.status == by_key[0], await r.text()
                async with session.post(flush, headers={"Authorization": "Bearer key-b"}) as r:
                    assert r.status == by_key[1], await r.text()
                    code = (await r.json())["error"]["code"]
                    assert code == (
                        "needs_admin_token" if admin_token is None else "invalid_admin_token"
                    )
                async with session.post(flush) as r:  # neither key nor token
                    assert r.status == by_nobody
                status, out = await complete(session, server, "key-a")
                assert status == 200 and cached(out) >= 48  # key-b emptied nothing
                if admin_token is not None:
                    async with session.post(
                        flush, headers={"Authorization": f"Bearer {admin_token}"}
                    ) as r:
                        assert r.status == 200, await r.text()
                    status, out = await complete(session, server, "key-a")
                    assert status == 200 and cached(out) == 0  # emptied
            assert await wait_until(functools.partial(engine_idle, server.engine))
        finally:
            await server.stop()


async def test_without_keys_or_admin_token_any_client_flushes() -> None:
    """A server with neither trusts whoever reaches it (loopback by default), as SGLang does."""
    server = await started()
    try:
        async with aiohttp.ClientSession() as session:
            status, _ = await complete(session, server)
            assert status == 200
            async with session.post(server.base_url + "/flush_cache") as r:
                assert r.status == 200, await r.text()
            status, out = await complete(session, server)
            assert status == 200 and cached(out) == 0
        assert await wait_until(functools.partial(engine_idle, server.engine))
    finally:
        await server.stop()


async def test_under_isolation_server_info_shows_a_key_no_cache_figures() -> None:
    """/get_server_info (SGLang's router reads it) shows a key holder what /metrics shows
    anyone: under isolation by key no hit, miss or cached-page figures; shared, all of them."""
    cache_figures = {"hit_tokens", "miss_tokens", "computed_tokens", "pages_cached"}
    for isolation, shown in (("api-key", set()), ("shared", cache_figures)):
        server = await started(api_key=["key-a", "key-b"], cache_isolation=isolation)
        try:
            async with aiohttp.ClientSession() as session:
                assert (await complete(session, server, "key-a"))[0] == 200
                async with session.get(
                    server.base_url + "/get_server_info",
                    headers={"Authorization": "Bearer key-b"},
                ) as r:
                    assert r.status == 200
                    (figures,) = (await r.json())["internal_states"]
            assert cache_figures & set(figures) == shown, isolation
            assert figures["running"] == 0 and figures["prompt_tokens"] > 0
        finally:
            await server.stop()


async def test_under_isolation_the_key_is_the_tenant_not_the_user_field() -> None:
    server = await started(api_key=["key-a", "key-b"], cache_isolation="api-key", admin_token="adm")
    try:
        async with aiohttp.ClientSession() as session:
            for user in ("alice", "bob"):
                status, _ = await complete(session, server, "key-a", user=user)
                assert status == 200
            async with session.get(
                server.base_url + "/metrics", headers={"Authorization": "Bearer adm"}
            ) as resp:
                scrape = await resp.text()
        key_a = key_tenant(hashlib.sha256(b"key-a").hexdigest())
        assert tenant_label(key_a) in scrape
        assert tenant_label("alice") not in scrape and tenant_label("bob") not in scrape
    finally:
        await server.stop()


async def test_cached_tokens_can_be_left_out_and_metrics_keep_tenants_behind_the_key() -> None:
    server = await started(api_key="k", report_cached_tokens=False)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                status, out = await complete(session, server, "k", user="tenant-secret")
                assert status == 200 and "prompt_tokens_details" not in out["usage"]
            async with session.post(
                server.base_url + "/generate",
                json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1}},
                headers={"Authorization": "Bearer k"},
            ) as resp:
                assert (
                    resp.status == 200 and "cached_tokens" not in (await resp.json())["meta_info"]
                )
            async with session.get(server.base_url + "/metrics") as resp:
                public = await resp.text()
            async with session.get(
                server.base_url + "/metrics", headers={"Authorization": "Bearer k"}
            ) as resp:
                whole = await resp.text()
        for text in (public, whole):
            assert "asyncengine_num_requests_running" in text
        assert "asyncengine_cache_hit_tokens_total" in whole
        assert tenant_label("tenant-secret") in whole and "tenant-secret" not in whole
        assert "cache_hit" not in public and "cache_miss" not in public
        assert "tenant" not in public and "kv_pages_cached" not in public
    finally:
        await server.stop()


async def test_a_key_sent_as_x_api_key_gets_the_whole_scrape() -> None:
    """Anthropic's clients send the key as ``x-api-key``: the scrape reads it as the API does."""
    server = await started(api_key="k")
    try:
        async with aiohttp.ClientSession() as session:
            assert (await complete(session, server, "k"))[0] == 200
            scrapes = []
            for headers in ({"Authorization": "Bearer k"}, {"x-api-key": "k"}, {"x-api-key": "x"}):
                async with session.get(server.base_url + "/metrics", headers=headers) as resp:
                    assert resp.status == 200
                    scrapes.append(await resp.text())
        bearer, x_api_key, wrong = scrapes
        assert "asyncengine_cache_hit_tokens_total" in bearer
        assert "asyncengine_cache_hit_tokens_total" in x_api_key
        assert "cache_hit" not in wrong  # a key the server does not hold: the public scrape
    finally:
        await server.stop()


def test_isolation_by_key_needs_a_key() -> None:
    engine = fake_engine()
    with pytest.raises(ValueError, match="needs an API key"):
        create_app(engine, cache_isolation="api-key")
    with pytest.raises(ValueError, match="cache_isolation"):
        create_app(engine, api_key="k", cache_isolation="user")
