"""Under cache isolation by key, what a key holder (or an open scrape) can read tells nothing
of another key's cached prompts: two servers that differ only in what the other key cached
(its prompts hit, or filled the pool and forced evictions) look the same through every read
route, over real HTTP, while that key's last prompt is computed and after; the admin token's
scrape still shows the pool and the cache."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp

from tests.api.test_scheduling_e2e import engine
from tests.server_support import RunningServer, engine_idle, start_server, wait_until

ADMIN = "adm"
KEYS = ["key-a", "key-b"]
PROMPT = "the same long system prompt, page after page of it"  # 50 tokens: 12 whole pages
# what key-b sends: the same prompt three times (two hits), or three prompts of the same
# length that share nothing (36 pages into a 32-page pool: evictions)
SAME = [PROMPT] * 3
DISTINCT = [f"{i}{PROMPT[1:]}" for i in range(3)]
# the read routes of a key holder; admin routes answer it 401/403 whatever the cache holds
READS = [
    "/metrics",
    "/server_info",
    "/get_server_info",
    "/get_load",
    "/health",
    "/v1/models",
    "/version",
    "/model_info",
    "/admin/policy",
    "/admin/eviction-policy",
]
# latency histograms and idle seconds tell of timing, not of the pool's figures
_TIMING = re.compile(r"^asyncengine_\w*seconds\w*(\{[^}]*\})? .*$", re.MULTILINE)


async def _server() -> RunningServer:
    eng = engine(delay=0.2, num_pages=32)  # a forward lasts long enough to look in on it
    await eng.start()
    return await start_server(
        eng.config, engine=eng, api_key=KEYS, cache_isolation="api-key", admin_token=ADMIN
    )


async def _send(session: aiohttp.ClientSession, server: RunningServer, prompt: str) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    headers = {"Authorization": "Bearer key-b"}
    async with session.post(server.base_url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()


async def _view(
    session: aiohttp.ClientSession, server: RunningServer, token: str | None
) -> dict[str, tuple[int, str]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    seen: dict[str, tuple[int, str]] = {}
    for path in READS:
        async with session.get(server.base_url + path, headers=headers) as r:
            seen[path] = (r.status, _TIMING.sub("", await r.text()))
    return seen


async def _views_after(prompts: list[str]) -> tuple[list[dict[str, Any]], str]:
    """What key-a and an open scrape see while key-b's last prompt is computed and once it is
    done, and the admin token's scrape then."""
    server = await _server()
    views = []
    try:
        async with aiohttp.ClientSession() as session:
            for prompt in prompts[:-1]:
                await _send(session, server, prompt)
            last = asyncio.create_task(_send(session, server, prompts[-1]))
            stats = server.engine.stats
            assert await wait_until(lambda: stats()["prefilling"] == 1, interval=0.005)
            views += [await _view(session, server, "key-a"), await _view(session, server, None)]
            assert stats()["prefilling"] == 1  # all of it read during that forward
            await last
            assert await wait_until(lambda: engine_idle(server.engine))
            views += [await _view(session, server, "key-a"), await _view(session, server, None)]
            async with session.get(
                server.base_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}
            ) as r:
                admin = await r.text()
        return views, admin
    finally:
        await server.stop()


async def test_another_keys_cached_prompts_look_the_same_to_a_key_holder() -> None:
    same, admin_same = await _views_after(SAME)
    distinct, admin_distinct = await _views_after(DISTINCT)
    for seen_same, seen_distinct in zip(same, distinct, strict=True):
        for path in READS:
            assert seen_same[path] == seen_distinct[path], path
    key_a_at_rest = same[2]
    assert key_a_at_rest["/metrics"][0] == key_a_at_rest["/server_info"][0] == 200
    assert "asyncengine_kv_pages_total 32.0" in key_a_at_rest["/metrics"][1]
    # and so is its size in bytes: 32 pages of 4 tokens, 1 byte each (the fake model's)
    assert "asyncengine_kv_pool_bytes 128.0" in key_a_at_rest["/metrics"][1]
    # the pool differs, and the operator sees it
    for family in ("kv_pages_free", "kv_pages_used", "cache_hit_tokens", "eviction_evictions"):
        assert f"asyncengine_{family}" in admin_same, family
    assert admin_same != admin_distinct
