"""The decision rule the prefix-aware routers share (SGLang's router): a load guard first, then
the replica holding the longest prefix when it covers enough of the prompt. The routers differ in
how they know what a replica holds (cache_aware: where prompts were sent; kv_events_router: what
the replicas' caches report) and in what they do when no replica holds enough."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from asyncengine.routing.base import ReplicaState


@dataclass(frozen=True, slots=True)
class PrefixRule:
    cache_threshold: float = 0.3  # share of the prompt a match must cover to decide the route
    # the load guard: the busiest replica has this many requests more than the idlest ...
    balance_abs_threshold: int = 32
    # ... and this many times as many
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")

    def imbalanced(self, replicas: Sequence[ReplicaState]) -> bool:
        """Loads too far apart: the idlest replica should take the request, cache or not."""
        busiest = max(r.load for r in replicas)
        idlest = min(r.load for r in replicas)
        return (
            busiest - idlest > self.balance_abs_threshold
            and busiest > self.balance_rel_threshold * idlest
        )

    def covers(self, matched_tokens: int, prompt_tokens: int) -> bool:
        """Whether a replica's match is long enough to route the prompt there."""
        return matched_tokens > 0 and matched_tokens >= self.cache_threshold * prompt_tokens
