"""A routing round of the replicas' router that finds no replica asks Ray Serve to back off:
Ray Serve retries a round that found none at once, without yielding its event loop, unless
the request's ``routing_context.should_backoff`` is set, and that loop also completes requests
and applies replica updates, so the serving process would route nothing again. Two such rounds:
a call for a replica that is gone (a flush right after a replica died) and every replica at
``max_ongoing_requests``. No Ray instance: the router object alone, as Ray Serve drives it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve._private.request_router.common import PendingRequest

from asyncengine.server.ray_serve.router import AsyncEngineRequestRouter

DEPLOYMENT = DeploymentID(name="AsyncEngineReplica", app_name="backoff-test")


@dataclass
class Replica:
    """What the router reads of a Ray Serve RunningReplica."""

    replica_id: ReplicaID
    max_ongoing_requests: int = 4
    routing_stats: dict[str, Any] = field(default_factory=dict)


def make_router() -> AsyncEngineRequestRouter:
    router = AsyncEngineRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(app=DEPLOYMENT.app_name, router="round-robin")
    return router


def pending(**kwargs: Any) -> PendingRequest:
    return PendingRequest(args=[], kwargs=kwargs, metadata=None, future=None)  # type: ignore[arg-type]


def test_a_call_for_a_replica_that_is_gone_backs_off() -> None:
    router = make_router()
    alive = Replica(ReplicaID("alive", DEPLOYMENT))
    request = pending(request_ids=["r"], replica="gone")
    chosen = asyncio.run(router.choose_replicas([alive], request))  # type: ignore[list-item]
    assert not any(chosen)
    assert request.routing_context.should_backoff


def test_replicas_all_at_their_limit_back_off() -> None:
    router = make_router()
    busy = Replica(ReplicaID("busy", DEPLOYMENT), max_ongoing_requests=2)
    router.replica_queue_len_cache.update(busy.replica_id, 2)
    request = pending(route_ids=[1, 2, 3], request_id="r")
    chosen = asyncio.run(router.choose_replicas([busy], request))  # type: ignore[list-item]
    assert not any(chosen)
    assert request.routing_context.should_backoff


def test_a_routed_request_goes_to_its_replica() -> None:
    router = make_router()
    free = Replica(ReplicaID("free", DEPLOYMENT))
    chosen = asyncio.run(router.choose_replicas([free], pending(route_ids=[1], request_id="r")))  # type: ignore[list-item]
    assert chosen == [[free]]
