"""Replica routers: which of several engine replicas serves a request (no Ray here).

``make_router("cache-aware" | "round-robin" | "least-loaded" | "kv-events", **options)``.
"""

from __future__ import annotations

import inspect
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
    _check_options(name, options)
    return ROUTERS[name](**options)


def _check_options(name: str, options: dict[str, Any]) -> None:
    """ValueError naming the first option router ``name`` does not take, or whose value is not
    a number where the option is one (options come from the command line as text)."""
    params = inspect.signature(ROUTERS[name]).parameters
    for key, value in options.items():
        if key not in params:
            known = ", ".join(params) or "none"
            raise ValueError(f"router {name!r} has no option {key!r} (its options: {known})")
        default = params[key].default
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        given = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and not given and not (value is None and "None" in str(params[key].annotation)):
            raise ValueError(f"router option {key} must be a number, got {value!r}")


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
