"""/metrics: counters and histograms move exactly as the requests served say; gauges mirror
engine.stats(); each app has its own registry."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.server.prometheus import ServerMetrics
from tests.server_support import (
    REPO_ROOT,
    RunningServer,
    engine_config,
    engine_idle,
    start_server,
    tiny_model_dir,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    running = await start_server(engine_config(tiny_model_dir(tmp_path_factory)))
    yield running
    await running.stop()


async def scrape(session: aiohttp.ClientSession, server: RunningServer) -> Samples:
    async with session.get(server.base_url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_counters_and_histograms_follow_the_requests(server: RunningServer) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        before = await scrape(session, server)
        engine_before = server.engine.stats()
        usages = []
        for i, max_tokens in enumerate((3, 5, 7)):
            body = {
                "prompt": f"request number {i} asks",
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            async with session.post(server.base_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                usages.append((await resp.json())["usage"])
        body = {
            "text": "native one",
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "stream": True,
        }
        async with session.post(server.base_url + "/generate", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        async with session.post(
            server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}
        ) as resp:
            assert resp.status == 400
        # one client that leaves mid-stream
        body = {"prompt": "leaving early", "max_tokens": 400, "ignore_eos": True, "stream": True}
        resp = await session.post(server.base_url + "/v1/completions", json=body)
        head = b""
        while head.count(b"\n\n") < 2:  # two chunks: the request has generated >= 2 tokens
            head += await asyncio.wait_for(resp.content.readany(), 30)
        resp.close()
        assert await wait_until(lambda: engine_idle(server.engine))
        engine_after = server.engine.stats()
        assert await wait_until(
            lambda: (
                server.metrics.counter_value(
                    "asyncengine_requests_total", {"endpoint": "completions", "outcome": "abort"}
                )
                == value(
                    before, "asyncengine_requests_total", endpoint="completions", outcome="abort"
                )
                + 1
            )
        )
        after = await scrape(session, server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("asyncengine_requests_total", endpoint="completions", outcome="success") == 3
    assert delta("asyncengine_requests_total", endpoint="completions", outcome="invalid") == 1
    assert delta("asyncengine_requests_total", endpoint="completions", outcome="abort") == 1
    assert delta("asyncengine_requests_total", endpoint="generate", outcome="success") == 1
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    native_prompt = len(server.engine.tokenizer.encode("native one"))
    leaving_prompt = len(server.engine.tokenizer.encode("leaving early"))
    # The token counters are the engine's: the aborted request's prompt and the tokens it
    # generated before its client left count too.
    assert delta("asyncengine_prompt_tokens_total") == prompt + native_prompt + leaving_prompt
    generated = delta("asyncengine_generation_tokens_total")
    assert generated == engine_after["generated_tokens"] - engine_before["generated_tokens"]
    assert generated >= 3 + 5 + 7 + 4 + 2
    assert delta("asyncengine_cache_hit_tokens_total") + delta(
        "asyncengine_cache_miss_tokens_total"
    ) == (prompt + native_prompt + leaving_prompt)
    assert delta("asyncengine_cache_hit_tokens_total") >= cached
    # The histograms see the four requests whose final output the server delivered.
    assert delta("asyncengine_time_to_first_token_seconds_count") == 4
    assert delta("asyncengine_e2e_request_latency_seconds_count") == 4
    assert delta("asyncengine_queue_time_seconds_count") == 4
    assert delta("asyncengine_inter_token_latency_seconds_count") == (3 - 1) + (5 - 1) + (7 - 1) + (
        4 - 1
    )
    assert delta("asyncengine_e2e_request_latency_seconds_sum") > 0


async def test_gauges_mirror_engine_stats(server: RunningServer) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        body = {"prompt": "keep running", "max_tokens": 400, "ignore_eos": True, "stream": True}
        resp = await session.post(server.base_url + "/v1/completions", json=body)
        await asyncio.wait_for(resp.content.readany(), 30)
        samples = await scrape(session, server)
        stats = server.engine.stats()
        resp.close()
    assert value(samples, "asyncengine_num_requests_running") == 1
    assert value(samples, "asyncengine_num_requests_prefilling") == 0
    assert value(samples, "asyncengine_num_requests_waiting") == 0
    assert value(samples, "asyncengine_retractions_total") == stats["retractions"]
    assert value(samples, "asyncengine_kv_pages_total") == stats["pages_total"]
    # the pool in bytes: what its tensors hold, K and V of every layer
    pool = server.engine.executor.runner.kv_pool
    assert value(samples, "asyncengine_kv_pool_bytes") == pool.nbytes > 0
    assert pool.num_slots == stats["pages_total"] * server.engine.config.page_size
    assert value(samples, "asyncengine_kv_pages_used") >= 1
    assert (
        value(samples, "asyncengine_kv_pages_free")
        + value(samples, "asyncengine_kv_pages_used")
        + value(samples, "asyncengine_kv_pages_cached")
        + value(samples, "asyncengine_kv_pages_tail")
        == stats["pages_total"]
    )
    assert await wait_until(lambda: engine_idle(server.engine))


async def test_metric_names_and_types(server: RunningServer) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.post(
            server.base_url + "/v1/completions", json={"prompt": "types", "max_tokens": 2}
        ) as resp:
            assert resp.status == 200
        async with session.get(server.base_url + "/metrics") as resp:
            text = await resp.text()
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    expected = {
        "asyncengine_requests": "counter",
        "asyncengine_prompt_tokens": "counter",
        "asyncengine_generation_tokens": "counter",
        "asyncengine_cache_hit_tokens": "counter",
        "asyncengine_cache_miss_tokens": "counter",
        "asyncengine_time_to_first_token_seconds": "histogram",
        "asyncengine_inter_token_latency_seconds": "histogram",
        "asyncengine_e2e_request_latency_seconds": "histogram",
        "asyncengine_queue_time_seconds": "histogram",
        "asyncengine_num_requests_running": "gauge",
        "asyncengine_num_requests_prefilling": "gauge",
        "asyncengine_retractions": "counter",
        "asyncengine_num_requests_waiting": "gauge",
        "asyncengine_kv_pages_used": "gauge",
        "asyncengine_kv_pages_cached": "gauge",
    }
    assert {name: types.get(name) for name in expected} == expected


def documented_series() -> set[str]:
    """The series docs/serving.md's "Health and metrics" names."""
    text = (REPO_ROOT / "docs" / "serving.md").read_text()
    section = text.split("## Health and metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"\basyncengine_[a-z_]+\b", section))


async def test_every_series_the_guide_names_is_served(server: RunningServer) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        body = {"prompt": "named", "max_tokens": 2, "user": "a tenant"}
        async with session.post(server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
        samples = await scrape(session, server)
    served = {name for name, _ in samples}
    named = documented_series()
    assert len(named) >= 20
    missing = {n for n in named if n not in served and f"{n}_count" not in served}
    assert not missing, missing


async def test_each_metrics_object_has_its_own_registry() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.count_request("completions", "success")
    assert (
        first.counter_value(
            "asyncengine_requests_total", {"endpoint": "completions", "outcome": "success"}
        )
        == 1
    )
    assert (
        second.counter_value(
            "asyncengine_requests_total", {"endpoint": "completions", "outcome": "success"}
        )
        == 0
    )


class _StatsOnly:
    """An engine as the collector sees it: only stats()."""

    def __init__(self, stats: dict[str, float]) -> None:
        self._stats = stats

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


async def test_engine_gauges_and_counters_come_from_their_stats_keys() -> None:
    stats = {"running": 4, "prefilling": 2, "waiting": 7, "retractions": 3, "generated_tokens": 11}
    metrics = ServerMetrics(_StatsOnly(stats))
    text = metrics.exposition().decode()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples["asyncengine_num_requests_running"] == 4
    assert samples["asyncengine_num_requests_prefilling"] == 2
    assert samples["asyncengine_num_requests_waiting"] == 7
    assert samples["asyncengine_retractions_total"] == 3
    assert samples["asyncengine_generation_tokens_total"] == 11
    assert "# TYPE asyncengine_retractions_total counter" in text


async def test_preemption_counters_come_from_their_stats_keys() -> None:
    stats = {
        "computed_tokens": 1000,
        "recomputed_tokens": 120,
        "swapped_out_bytes": 4096,
        "swapped_in_bytes": 2048,
        "swap_seconds": 0.25,
    }
    text = ServerMetrics(_StatsOnly(stats)).exposition().decode()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples["asyncengine_computed_tokens_total"] == 1000
    assert samples["asyncengine_recomputed_tokens_total"] == 120
    assert samples["asyncengine_swap_out_bytes_total"] == 4096
    assert samples["asyncengine_swap_in_bytes_total"] == 2048
    assert samples["asyncengine_swap_seconds_total"] == 0.25


async def test_the_host_tier_and_pins_are_scraped_behind_the_key(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # a pool of 16 pages of 4 tokens, a host tier beside it; the first prompt is pushed out by
    # the others and served from the host tier when it comes back
    config = engine_config(
        tiny_model_dir(tmp_path_factory),
        page_size=4,
        kv_cache_tokens=64,
        max_model_len=64,
        host_kv_tier=True,
        swap_space_bytes=1 << 20,
    )
    server = await start_server(config, api_key="k", admin_token="adm")
    key, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.post(
                server.base_url + "/v1/cache/pin", json={"prompt": "pinned " * 2}, headers=admin
            ) as resp:
                assert resp.status == 200
                pinned = (await resp.json())["pages"]
            for word in ("first", "second", "third", "fourth", "first"):
                body = {"prompt": f"{word} " * 24, "max_tokens": 2}  # 6 whole pages
                async with session.post(
                    server.base_url + "/v1/completions", json=body, headers=key
                ) as resp:
                    assert resp.status == 200
            stats = server.engine.stats()
            async with session.get(server.base_url + "/metrics", headers=key) as resp:
                whole = {
                    sample.name: sample.value
                    for family in text_string_to_metric_families(await resp.text())
                    for sample in family.samples
                }
            async with session.get(server.base_url + "/metrics") as resp:
                public = await resp.text()
    finally:
        await server.stop()
    assert stats["host_hit_tokens"] > 0 and stats["tier_in_bytes"] > 0
    assert whole["asyncengine_host_tier_hit_tokens_total"] == stats["host_hit_tokens"]
    assert whole["asyncengine_host_tier_out_bytes_total"] == stats["tier_out_bytes"]
    assert whole["asyncengine_host_tier_in_bytes_total"] == stats["tier_in_bytes"]
    assert whole["asyncengine_host_tier_pages"] == stats["host_tier_pages"] > 0
    assert whole["asyncengine_kv_pages_pinned"] == pinned > 0
    # pinned pages are cached pages, and the swap seconds count the host tier's copies
    assert "host_tier" not in public and "kv_pages_pinned" not in public
    assert "swap_seconds" not in public and "asyncengine_swap_seconds_total" in whole
