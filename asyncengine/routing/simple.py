"""Routers that ignore the prompt: round-robin and least-loaded."""

from __future__ import annotations

from collections.abc import Sequence

from asyncengine.routing.base import ReplicaRouter, ReplicaState, RouteDecision


class RoundRobinRouter(ReplicaRouter):
    """Each replica in turn (by id order)."""

    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0

    def _choose(
        self, tokens: Sequence[int], replicas: list[ReplicaState], now: float
    ) -> RouteDecision:
        replica = replicas[self._turn % len(replicas)]
        self._turn += 1
        return RouteDecision(replica.replica_id, "round_robin")


class LeastLoadedRouter(ReplicaRouter):
    """The replica with the fewest requests in flight; equal loads take turns."""

    name = "least-loaded"

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0

    def _choose(
        self, tokens: Sequence[int], replicas: list[ReplicaState], now: float
    ) -> RouteDecision:
        n = len(replicas)
        index = min(range(n), key=lambda i: (replicas[i].load, (i - self._turn) % n))
        self._turn = index + 1
        return RouteDecision(replicas[index].replica_id, "least_loaded")
