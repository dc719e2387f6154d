"""What a replica router sees and decides: plain data, and the base class every router shares.

A router picks one replica for each generation request from the request's prompt token ids and
the replicas' current state. The same router objects run inside the Ray Serve deployment (see
asyncengine/server/ray_serve/router.py) and in the simulator's multi-replica mode, so a routing
policy studied on a simulated trace is the one that serves. Routers know no Ray.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from asyncengine.cache.kv_events import KVEvent


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as the router sees it when a request arrives."""

    replica_id: str
    load: int = 0  # requests sent to it and not finished
    # the replica's real prefix-cache capacity in tokens, when it reports it
    cache_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica_id: str
    # prefix: the replica most likely to hold the prompt's prefix; load_guard: the least loaded,
    # because the loads are too far apart; least_cached: no replica holds enough of the prompt,
    # so the one holding the fewest tokens; affinity (kv-events): none holds enough, so the one
    # its prefix was last routed to; least_loaded / round_robin: those routers' picks
    reason: str
    matched_tokens: int = 0  # prompt tokens the router believes the replica holds


class ReplicaRouter(ABC):
    """Picks a replica per request; counts its decisions by reason."""

    name: ClassVar[str]
    # whether it routes on the replicas' KV cache events (its drivers then feed ``observe``)
    consumes_kv_events: ClassVar[bool] = False

    def __init__(self) -> None:
        self.decisions: Counter[str] = Counter()

    def observe(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        """KV cache events ``replica_id`` published (cache/kv_events.py); ignored by routers
        that do not consume them."""
        return None

    def route(
        self, tokens: Sequence[int], replicas: Sequence[ReplicaState], now: float
    ) -> RouteDecision:
        """Choose among ``replicas`` (any order: they are taken sorted by id, so that equal
        choices break the same way everywhere) for a prompt of ``tokens`` arriving at ``now``."""
        if not replicas:
            raise ValueError("no replica to route to")
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        decision = self._choose(tokens, ordered, now)
        self.decisions[decision.reason] += 1
        return decision

    @abstractmethod
    def _choose(
        self, tokens: Sequence[int], replicas: list[ReplicaState], now: float
    ) -> RouteDecision: ...

    def forget(self, replica_id: str) -> None:
        """``replica_id`` is gone (died, scaled down): drop what is known of it."""
        return None

    def reset(self) -> None:
        """The replicas' caches were flushed."""
        return None

    def tree_stats(self) -> dict[str, int]:
        """Size of the router's own state (empty for routers that keep none)."""
        return {}
