"""/metrics of replicas: what each replica reports of its engine (replica.reported_stats) comes
out with a ``replica`` label, the scheduler's counters and admission blocks by reason included,
as one engine's /metrics has them. Real engines' stats, read as the HTTP side reads the
replicas' reports (without Ray: the collector only reads them)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.server.ray_serve.metrics import replica_metrics
from asyncengine.server.ray_serve.remote_engine import RemoteEngine
from asyncengine.server.ray_serve.replica import reported_stats
from tests.server_support import engine_config, tiny_model_dir


class ReportedReplicas:
    """What the collector reads of a RemoteEngine: the replicas' last reports, no router."""

    def __init__(self, reports: dict[str, dict[str, Any]]) -> None:
        self.reports = reports

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        return self.reports

    def router(self) -> None:
        return None

    @property
    def model_name(self) -> str:
        return "tiny"


async def engine_stats(tmp_path_factory: pytest.TempPathFactory, requests: int) -> Any:
    """A real engine's stats after ``requests`` requests at once, one running at a time."""
    config = engine_config(tiny_model_dir(tmp_path_factory), max_running_requests=1)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.0)
    async with AsyncEngine(config) as engine:
        await asyncio.gather(*(engine.generate(f"prompt {i}", params) for i in range(requests)))
        return engine.stats()


@pytest.mark.asyncio
async def test_each_replica_reports_its_scheduler_counters(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    stats = await engine_stats(tmp_path_factory, 3)
    assert stats["admission_blocked"]["running_cap"] > 0
    idle = await engine_stats(tmp_path_factory, 1)
    reports = {"a": reported_stats(stats), "b": reported_stats(idle)}
    metrics = replica_metrics(cast(RemoteEngine, ReportedReplicas(reports)))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    for replica, replica_stats in (("a", stats), ("b", idle)):
        for reason, count in replica_stats["admission_blocked"].items():
            assert value(
                "asyncengine_admission_blocked_total", replica=replica, reason=reason
            ) == float(count)
        assert value("asyncengine_preemptions_total", replica=replica) == 0.0
        assert value("asyncengine_request_timeouts_total", replica=replica) == 0.0
        assert value("asyncengine_prompt_tokens_total", replica=replica) == float(
            replica_stats["prompt_tokens"]
        )
    assert value("asyncengine_replicas") == 2.0


@pytest.mark.asyncio
async def test_the_replicas_stats_add_up_admission_blocks_by_reason(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """GET /admin/policy reads them from stats(), as of one engine."""
    busy, idle = await engine_stats(tmp_path_factory, 3), await engine_stats(tmp_path_factory, 2)
    reports = {"a": reported_stats(busy), "b": reported_stats(idle)}
    replicas = cast(RemoteEngine, ReportedReplicas(reports))
    blocked = RemoteEngine.stats(replicas)["admission_blocked"]
    assert blocked == {
        reason: busy["admission_blocked"][reason] + idle["admission_blocked"][reason]
        for reason in busy["admission_blocked"]
    }
    assert blocked["running_cap"] > busy["admission_blocked"]["running_cap"] > 0


@pytest.mark.asyncio
async def test_the_replicas_stats_say_their_eviction_policy_and_evictions_by_rule(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """GET /admin/eviction-policy reads them from stats(): the replicas' shared policy and
    their evictions by rule added up, as of one engine."""
    config = engine_config(tiny_model_dir(tmp_path_factory), kv_cache_tokens=16 * 12)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=0.0)
    reports, by_rule = {}, []
    for replica, prompts in (("a", 6), ("b", 3)):
        async with AsyncEngine(config) as engine:
            for i in range(prompts):  # one after the other: each caches its pages, then evicts
                await engine.generate(f"replica {replica} prompt {i} " * 12, params)
            stats = engine.stats()
        reports[replica] = reported_stats(stats)
        by_rule.append(stats["eviction_by_rule"]["lru"])
    assert by_rule[0]["evictions"] > 0
    total = RemoteEngine.stats(cast(RemoteEngine, ReportedReplicas(reports)))
    assert total["eviction_policy"] == "lru"
    assert total["eviction_rule"] == {}
    assert total["eviction_by_rule"] == {
        "lru": {key: count + by_rule[1][key] for key, count in by_rule[0].items()}
    }
