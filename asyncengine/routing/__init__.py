"""Replica routers: which of several engine replicas serves a request (no Ray here).

``make_router("cache-aware" | "round-robin" | "least-loaded" | "kv-events", **options)``.
"""

from __future__ import annotations

from typing import Any

from asyncengine.routing.base import ReplicaRouter, ReplicaState, RouteDecision
from asyncengine.routing.cache_aware import CacheAwareRouter
from asyncengine.routing.kv_events_router import KVEventsRouter
from asyncengine.routing.prefix_tree import PrefixTree
from asyncengine.routing.simple import LeastLoadedRouter, RoundRobinRouter

ROUTERS: dict[str, type[ReplicaRouter]] = {
    CacheAwareRouter.name: CacheAwareRouter,
    RoundRobinRouter.name: RoundRobinRouter,
    LeastLoadedRouter.name: LeastLoadedRouter,
    KVEventsRouter.name: KVEventsRouter,
}


def make_router(name: str, **options: Any) -> ReplicaRouter:
    """A fresh router by name; ``options`` go to its constructor (cache-aware takes some)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}: choose one of {', '.join(ROUTERS)}")
    return ROUTERS[name](**options)


__all__ = [
    "ROUTERS",
    "CacheAwareRouter",
    "KVEventsRouter",
    "LeastLoadedRouter",
    "PrefixTree",
    "ReplicaRouter",
    "ReplicaState",
    "RouteDecision",
    "RoundRobinRouter",
    "make_router",
]
