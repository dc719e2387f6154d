"""EngineReplica: one AsyncEngine inside a Ray Serve replica actor.

The driver's RemoteEngine calls ``stream``/``generate`` with the prompt as the HTTP app gave it
(the replica tokenizes and validates it exactly as a single engine does) plus ``route_ids``,
the prompt's token ids that the router in the driver read; a call cancelled by the driver
cancels the task iterating the engine's stream, which aborts the request and frees its KV.
An engine's refusal (bad input, full queue) comes back as the exception object itself, as a
value rather than raised: it is the client's error, not the replica's, and Ray logs raised
exceptions as failures.
``record_routing_stats`` hands the engine's counters (``reported_stats``) and its prefix-cache
capacity to the routers every few seconds (Ray Serve polls it); ``check_health`` fails once the
engine loop has stopped, so that Ray Serve replaces the replica.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import EngineNotRunningError, InvalidRequestError, QueueFullError
from asyncengine.common.outputs import EmbeddingOutput, GenerateOutput, StreamDelta
from asyncengine.common.sampling_params import SamplingParams

REFUSALS = (InvalidRequestError, QueueFullError, EngineNotRunningError)
ADMISSION_BLOCKED = "admission_blocked"
EVICTION_POLICY = "eviction_policy"
EVICTION_RULE = "eviction_rule"
EVICTION_BY_RULE = "eviction_by_rule"


def cache_tokens(stats: dict[str, Any], page_size: int) -> int:
    """The prefix cache's capacity in tokens: the whole KV pool (the tree may fill it)."""
    return int(stats.get("pages_total", 0)) * page_size


def reachable_endpoint(endpoint: str) -> str:
    """The publisher's endpoint as another node reaches it: a wildcard host is this node's IP."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if host in ("0.0.0.0", "*"):
        import ray

        return endpoint.replace(host, ray.util.get_node_ip_address(), 1)
    return endpoint


def reported_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """What a replica reports of its engine's ``stats()``: numbers only, which the router adds
    up. Beside the engine's numbers: the admission blocks by reason as
    ``admission_blocked:<reason>`` (a fixed set; /metrics labels them), the eviction policy
    as ``eviction_policy:<name>`` = 1, its rule's figures as ``eviction_rule:<key>`` and the
    evictions by rule as ``eviction_by_rule:<rule>:<key>`` (GET /admin/eviction-policy)."""
    reported: dict[str, Any] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    for reason, count in (stats.get(ADMISSION_BLOCKED) or {}).items():
        reported[f"{ADMISSION_BLOCKED}:{reason}"] = count
    if stats.get(EVICTION_POLICY) is not None:
        reported[f"{EVICTION_POLICY}:{stats[EVICTION_POLICY]}"] = 1
    for key, value in (stats.get(EVICTION_RULE) or {}).items():
        reported[f"{EVICTION_RULE}:{key}"] = value
    for rule, counts in (stats.get(EVICTION_BY_RULE) or {}).items():
        for key, count in counts.items():
            reported[f"{EVICTION_BY_RULE}:{rule}:{key}"] = count
    return reported


class EngineReplica:
    async def __init__(self, config: EngineConfig) -> None:  # type: ignore[misc]
        from asyncengine.api.engine import AsyncEngine  # loads torch: in the replica only

        self.config = config
        self.engine = AsyncEngine(config)
        await self.engine.start()

    async def stream(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        route_ids: list[int] | None = None,
    ) -> AsyncIterator[StreamDelta | Exception | int | None]:
        """None first, once the engine accepted the request (RemoteStream.accepted), then its
        prompt tokens read from the prefix cache once it is scheduled (RemoteStream.admitted),
        then its deltas; or a refusal."""
        try:
            stream = self.engine.stream(prompt, params, request_id=request_id)
            await stream.accepted()
            yield None
            yield await stream.admitted()
            async for delta in stream:
                yield delta
        except REFUSALS as exc:
            yield exc

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        route_ids: list[int] | None = None,
    ) -> GenerateOutput | Exception:
        try:
            return await self.engine.generate(prompt, params, request_id=request_id)
        except REFUSALS as exc:
            return exc

    async def generate_choices(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        route_ids: list[int] | None = None,
    ) -> list[GenerateOutput] | Exception:
        try:
            return await self.engine.generate_choices(prompt, params, request_id=request_id)
        except REFUSALS as exc:
            return exc

    async def embed(
        self,
        prompt: Any,
        params: SamplingParams | None,
        request_id: str,
        route_ids: list[int] | None = None,
    ) -> EmbeddingOutput | Exception:
        """``engine.embed``."""
        try:
            return await self.engine.embed(prompt, params, request_id=request_id)
        except REFUSALS as exc:
            return exc

    async def info(self) -> dict[str, Any]:
        """What the driver needs to know of the model, and who answers (tests kill by pid)."""
        from ray import serve

        engine = self.engine
        return {
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "pid": os.getpid(),
            "model_name": engine.model_name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "cache_tokens": cache_tokens(engine.stats(), self.config.page_size),
        }

    async def abort(self, request_ids: list[str], replica: str | None = None) -> int:
        """Abort those of ``request_ids`` this replica's engine holds; each ends its stream
        with a final ``abort`` delta, as a local engine's requests do. Answers how many."""
        return sum(self.engine.abort(rid) for rid in request_ids)

    async def flush_cache(self, replica: str | None = None, reset_counters: bool = False) -> None:
        """Empty the prefix cache, and with ``reset_counters`` the engine's counters (EngineError
        while requests run)."""
        await self.engine.reset_prefix_cache(reset_counters=reset_counters)

    def record_routing_stats(self) -> dict[str, Any]:
        stats = reported_stats(self.engine.stats())
        stats["cache_tokens"] = cache_tokens(stats, self.config.page_size)
        if self.engine.kv_events is not None:  # a kv-events router subscribes to it
            stats["kv_events_endpoint"] = reachable_endpoint(self.engine.kv_events.endpoint)
        return stats

    async def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the engine loop is not running")

    async def __del__(self) -> None:
        await self.engine.stop()
