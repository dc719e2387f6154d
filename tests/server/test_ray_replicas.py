"""Replicas on Ray Serve: a local Ray, two replicas of a tiny random model on the CPU, the HTTP
app in this process (its router too, so its decisions can be read).

On a grouped workload (requests sharing prefixes, sent one after the other), the cache-aware
router keeps each group on one replica, so the replicas together hit the prefix cache as
often as one engine does, while round-robin loses about half of those hits; both route exactly
as the simulator's multi-replica mode does on the same trace.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.config import EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.routing import make_router
from asyncengine.server.app import create_app
from asyncengine.server.ray_serve.deployment import RayDeployment, RayOptions
from asyncengine.server.ray_serve.metrics import replica_metrics
from asyncengine.server.ray_serve.remote_engine import RemoteEngine
from asyncengine.server.serve import start_http
from asyncengine.sim.multi_replica import MultiReplicaSimulator
from asyncengine.workloads import Arrivals, make_workload
from asyncengine.workloads.trace import WorkloadRequest
from tests.ray_support import canonical, start_local_ray, stop_local_ray
from tests.server_support import engine_config, sse_json, tiny_model_dir

pytestmark = pytest.mark.slow

OUTPUT_LEN = 4
TIMEOUT = aiohttp.ClientTimeout(total=60)


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    start_local_ray(num_cpus=2)
    try:
        yield
    finally:
        stop_local_ray()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return engine_config(tiny_model_dir(tmp_path_factory))


def grouped_workload() -> list[WorkloadRequest]:
    """12 prefixes of 64 tokens (4 pages), 3 short questions behind each, shuffled; in the
    simulator they arrive far enough apart that each ends before the next, as sent here."""
    return make_workload(
        "shared_prefix",
        num_groups=12,
        questions_per_group=3,
        prefix_len=64,
        vocab_size=49152,
        question_median=12.0,
        max_question_len=24,
        output_len=OUTPUT_LEN,
        arrivals=Arrivals.parse("interval:10"),
        seed=0,
    )


async def single_engine_hits(config: EngineConfig, workload: list[WorkloadRequest]) -> int:
    params = SamplingParams(max_new_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0.0)
    async with AsyncEngine(config) as engine:
        outputs = [await engine.generate(w.prompt_ids, params) for w in workload]
    return sum(o.usage.cached_tokens for o in outputs)


def body(item: WorkloadRequest, **sampling: Any) -> dict[str, Any]:
    params = {"max_new_tokens": OUTPUT_LEN, "ignore_eos": True, "temperature": 0, **sampling}
    return {"input_ids": item.prompt_ids, "sampling_params": params, "rid": item.rid}


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def serve_trace(
    config: EngineConfig, handle: Any, app_name: str, workload: list[WorkloadRequest]
) -> dict[str, Any]:
    """Send the trace one request at a time through the HTTP app; what the test checks."""
    engine = RemoteEngine(config, handle, app_name)
    await engine.start()
    app = create_app(engine, metrics=replica_metrics(engine))
    runner, port = await start_http(app, "127.0.0.1", 0, shutdown_grace=2.0)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            cached = 0
            for item in workload:
                async with session.post(f"{base}/generate", json=body(item)) as resp:
                    assert resp.status == 200, await resp.text()
                    meta = (await resp.json())["meta_info"]
                assert meta["completion_tokens"] == OUTPUT_LEN
                cached += meta["cached_tokens"]
            # a streamed request: the same SSE frames as one engine's
            async with session.post(f"{base}/generate", json={**body(workload[0]), "rid": "s", "stream": True}) as resp:  # fmt: skip
                assert resp.status == 200
                frames = sse_json(await resp.read())
            assert frames[-1]["meta_info"]["finish_reason"] == {
                "type": "length",
                "length": OUTPUT_LEN,
            }
            # n > 1: the replica forks the choices; plain and streamed
            two = {"prompt": workload[2].prompt_ids, "n": 2, "max_tokens": 3, "temperature": 1.0}
            async with session.post(f"{base}/v1/completions", json={**two, "seed": 1}) as resp:
                assert resp.status == 200, await resp.text()
                assert sorted(c["index"] for c in (await resp.json())["choices"]) == [0, 1]
            async with session.post(f"{base}/v1/completions", json={**two, "stream": True}) as resp:
                chunks = sse_json(await resp.read())
            ends = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
            assert sorted(ends) == [0, 1]
            # the engine's own refusals keep their status and message
            bad = {"input_ids": [49152], "sampling_params": {"max_new_tokens": 2}}
            async with session.post(f"{base}/generate", json=bad) as resp:
                assert resp.status == 400
                assert "outside the vocabulary" in (await resp.json())["error"]["message"]
            # a client that leaves mid-stream: its replica aborts the request and frees its KV
            gone = {**body(workload[1], max_new_tokens=400), "rid": "gone", "stream": True}
            async with session.post(f"{base}/generate", json=gone) as resp:
                assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
            for _ in range(100):
                stats = engine.stats()
                if stats.get("finished_abort") == 1 and stats.get("pages_used", 1) == 0:
                    break
                await asyncio.sleep(0.1)
            assert stats["finished_abort"] == 1 and stats["running"] == stats["pages_used"] == 0
            # the replicas report every 1 s: wait until /metrics has all their hits
            for _ in range(100):
                async with session.get(f"{base}/metrics") as resp:
                    text = await resp.text()
                if metric(text, "asyncengine_prompt_tokens_total") >= sum(
                    len(w.prompt_ids) for w in workload
                ) + len(workload[0].prompt_ids) + len(workload[1].prompt_ids) + 2 * len(
                    workload[2].prompt_ids
                ):
                    break
                await asyncio.sleep(0.1)
        router = engine.router()
        log = [d for d in router.decision_log() if d.request_id in {w.rid for w in workload}]
        return {"cached": cached, "log": log, "metrics": text, "engine": engine}
    finally:
        await engine.stop()
        await runner.cleanup()


def simulated_routes(config: EngineConfig, router: str, workload: list[WorkloadRequest]) -> Any:
    return MultiReplicaSimulator(config, 2, make_router(router)).run(workload)


def assert_same_routes(real_log: list[Any], simulated: Any) -> None:
    real = [(d.request_id, d.reason) for d in real_log]
    sim = [(d.rid, d.reason) for d in simulated.decisions]
    assert real == sim
    assert canonical([d.replica_id for d in real_log]) == canonical(
        [d.replica for d in simulated.decisions]
    )


def deploy(config: EngineConfig, router: str, app_name: str) -> tuple[RayDeployment, Any]:
    deployment = RayDeployment(RayOptions(replicas=2, router=router, app_name=app_name))
    return deployment, deployment.open(config)


def test_cache_aware_replicas_hit_like_one_engine_and_route_as_simulated(
    ray_cluster: Any, config: EngineConfig
) -> None:
    workload = grouped_workload()
    single = asyncio.run(single_engine_hits(config, workload))
    assert single == 12 * 2 * 64  # every group's second and third prompts hit its 4 pages
    deployment, handle = deploy(config, "cache-aware", "cache_aware")
    try:
        run = asyncio.run(serve_trace(config, handle, "cache_aware", workload))
    finally:
        deployment.close()
    assert run["cached"] >= 0.9 * single
    assert_same_routes(run["log"], simulated_routes(config, "cache-aware", workload))
    reasons = [d.reason for d in run["log"]]
    assert reasons.count("prefix") == 24 and reasons.count("least_cached") == 12
    text = run["metrics"]
    replicas = set(re.findall(r'asyncengine_cache_hit_tokens_total\{replica="([^"]+)"\}', text))
    assert len(replicas) == 2
    assert metric(text, "asyncengine_cache_hit_tokens_total") >= run["cached"]
    assert metric(text, "asyncengine_router_decisions_total", reason="prefix") >= 24
    assert metric(text, "asyncengine_router_tree_nodes") > 12
    assert metric(text, "asyncengine_replicas") == 2


def test_round_robin_replicas_lose_the_hits_and_route_as_simulated(
    ray_cluster: Any, config: EngineConfig
) -> None:
    workload = grouped_workload()
    deployment, handle = deploy(config, "round-robin", "round_robin")
    try:
        run = asyncio.run(serve_trace(config, handle, "round_robin", workload))
    finally:
        deployment.close()
    simulated = simulated_routes(config, "round-robin", workload)
    assert_same_routes(run["log"], simulated)
    assert run["cached"] == sum(r.cached_tokens for r in simulated.records)
    assert run["cached"] <= 0.7 * 12 * 2 * 64
    assert metric(run["metrics"], "asyncengine_router_decisions_total", reason="round_robin") >= 36


def test_kv_events_replicas_route_on_what_the_caches_report(
    ray_cluster: Any, config: EngineConfig
) -> None:
    """The replicas publish their caches' events, the router subscribes to each and routes on
    them: every group stays on one replica, as with cache-aware routing; embeddings go through
    the replicas too."""
    workload = grouped_workload()
    deployment, handle = deploy(config, "kv-events", "kv_events")

    async def embed(engine: Any) -> list[float]:
        return list((await engine.embed(workload[0].prompt_ids)).embedding)

    try:
        run = asyncio.run(serve_trace(config, handle, "kv_events", workload))
        remote = RemoteEngine(config, handle, "kv_events")
        asyncio.run(remote.start())
        try:
            vector = asyncio.run(embed(remote))
        finally:
            asyncio.run(remote.stop())
        router = run["engine"].router()
        feed = router.feed
        held = {replica: set(blocks.held) for replica, blocks in router.policy.replicas.items()}
    finally:
        deployment.close()
    assert len(vector) == 64 and abs(sum(x * x for x in vector) - 1.0) < 1e-6
    assert feed is not None and feed.batches > 0
    assert len(held) == 2 and all(held.values())
    reasons = [d.reason for d in run["log"]]
    assert reasons.count("prefix") == 24 and reasons.count("least_cached") == 12
    assert run["cached"] >= 0.9 * 12 * 2 * 64
