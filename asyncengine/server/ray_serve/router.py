"""AsyncEngineRequestRouter: Ray Serve's RequestRouter around one of asyncengine.routing's.

Ray Serve builds it in every process that holds a handle to the deployment (here: the serving
process) and asks ``choose_replicas`` for each request. A generation call carries the prompt's
token ids (``route_ids``): the wrapped router picks one replica from each replica's requests
in flight (Ray Serve's queue-length cache, kept by this handle's sends and completions) and
its reported cache capacity (``routing_stats``). A call that names a ``replica`` (abort,
flush) goes to that replica only; any other call goes to the least loaded.

The routers of this process register under their application's name (registry.py) so that
the HTTP side (metrics, flush) can read their counters, decision log and per-replica stats.
Ray Serve pickles this module by value: module-level state here would not be shared.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from asyncengine.cache.kv_events import KVEvent
from asyncengine.routing import ReplicaRouter, ReplicaState, make_router
from asyncengine.server.ray_serve.kv_events_feed import KVEventsFeed
from asyncengine.server.ray_serve.registry import LoggedDecision, register

DECISION_LOG_SIZE = 100_000


class AsyncEngineRequestRouter(RequestRouter):
    policy: ReplicaRouter

    def initialize_state(self, **kwargs: Any) -> None:
        self.app = str(kwargs.get("app", ""))
        self.policy = make_router(
            str(kwargs.get("router", "cache-aware")), **kwargs.get("options", {})
        )
        self.log: deque[LoggedDecision] = deque(maxlen=DECISION_LOG_SIZE)
        # choose_replicas runs on Ray Serve's router loop, readers on the HTTP loop
        self.lock = threading.Lock()
        # a router that routes on the replicas' KV cache events reads them on a thread
        self.feed: KVEventsFeed | None = None
        if self.policy.consumes_kv_events:
            self.feed = KVEventsFeed(self._observe)
        register(self.app, self)

    def _observe(self, replica_id: str, events: Sequence[KVEvent]) -> None:
        with self.lock:
            self.policy.observe(replica_id, events)

    # -- routing ------------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Ray Serve sleeps between rounds that found no replica only when this is set
            # (its locality rounds set it); unset, it asks again at once without yielding its
            # event loop, which then never routes, completes or updates anything again
            pending_request.routing_context.should_backoff = True
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("replica")
        if target is not None:  # none while that replica is gone: the caller times out
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        available = self.select_available_replicas(candidate_replicas)
        if not available:
            return []  # every replica is at max_ongoing_requests: Ray Serve backs off
        states = [self._state(r) for r in available]
        by_id = {r.replica_id.unique_id: r for r in available}
        route_ids = kwargs.get("route_ids")
        if route_ids is None:
            idlest = min(states, key=lambda s: s.load)
            return [[by_id[idlest.replica_id]]]
        with self.lock:
            decision = self.policy.route(route_ids, states, time.monotonic())
            self.log.append(
                LoggedDecision(
                    str(kwargs.get("request_id", "")),
                    decision.replica_id,
                    decision.reason,
                    decision.matched_tokens,
                )
            )
        return [[by_id[decision.replica_id]]]

    def _state(self, replica: RunningReplica) -> ReplicaState:
        load = self.replica_queue_len_cache.get(replica.replica_id) or 0
        stats = replica.routing_stats or {}
        capacity = stats.get("cache_tokens")
        endpoint = stats.get("kv_events_endpoint")
        if self.feed is not None and isinstance(endpoint, str):
            self.feed.follow(replica.replica_id.unique_id, endpoint)
        return ReplicaState(replica.replica_id.unique_id, load, capacity or None)

    # -- replica churn --------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._forget(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _forget(self, unique_id: str) -> None:
        if self.feed is not None:
            self.feed.drop(unique_id)
        with self.lock:
            self.policy.forget(unique_id)

    # -- what the HTTP side reads -----------------------------------------------------------------
    def replica_ids(self) -> list[str]:
        return sorted(r.unique_id for r in self.curr_replicas)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each live replica's last reported engine stats (empty until its first report)."""
        return {
            r.replica_id.unique_id: dict(r.routing_stats or {})
            for r in list(self.curr_replicas.values())
        }

    def decisions(self) -> dict[str, int]:
        with self.lock:
            return dict(self.policy.decisions)

    def tree_stats(self) -> dict[str, int]:
        with self.lock:
            return self.policy.tree_stats()

    def decision_log(self) -> list[LoggedDecision]:
        with self.lock:
            return list(self.log)

    def reset_tree(self) -> None:
        with self.lock:
            self.policy.reset()
