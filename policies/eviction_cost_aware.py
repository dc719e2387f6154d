"""``cost-aware``: the pages cheapest to recompute per byte go first (GreedyDual, Cao and Irani
1997), aged like LFU-DA so that a costly page nobody uses still leaves in time.

Recomputing a page costs its tokens' projections (the same for every page) plus attention over
everything before it, so a page's cost per byte grows with its depth: shallow pages go first,
deep ones (the end of a long shared context) last. A leaf's key is the floor at its last use
plus its cost per token relative to a token at depth 0: ``1 + depth / attention_tokens``, where
``attention_tokens`` is the depth at which attention costs as much as the rest of a token."""

from __future__ import annotations

from typing import Any

from asyncengine.cache.eviction_rule import CachedNode, EvictionRule


class CostAware(EvictionRule):
    name = "cost-aware"
    touches = True

    def __init__(self, attention_tokens: int = 2048) -> None:
        if attention_tokens <= 0:
            raise ValueError(f"attention_tokens must be positive, got {attention_tokens}")
        self.attention_tokens = attention_tokens
        self.floor = 0.0

    def cost_per_token(self, node: CachedNode) -> float:
        middle = node.prefix_len - len(node.key) / 2  # mean depth of the edge's tokens
        return 1.0 + middle / self.attention_tokens

    def key(self, node: CachedNode) -> float:
        return node.score

    def touch(self, node: CachedNode) -> None:
        node.score = self.floor + self.cost_per_token(node)

    def evicted(self, node: CachedNode, key: float) -> None:
        self.floor = max(self.floor, key)

    def stats(self) -> dict[str, Any]:
        return {"floor": self.floor}
