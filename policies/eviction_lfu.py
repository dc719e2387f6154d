"""``lfu``: least frequently used first, with dynamic aging (LFU-DA, Arlitt et al. 2000).

A leaf's key is the floor at its last use plus its use count; the floor rises to the key of
each leaf evicted, so a page used often long ago ages out instead of staying forever. It takes
no options: a weight on the use count would scale every key and the floor alike, so it could
not change which page goes first."""

from __future__ import annotations

from typing import Any

from asyncengine.cache.eviction_rule import CachedNode, EvictionRule


class LeastFrequentlyUsed(EvictionRule):
    name = "lfu"
    touches = True

    def __init__(self) -> None:
        self.floor = 0.0

    def key(self, node: CachedNode) -> float:
        return node.score

    def touch(self, node: CachedNode) -> None:
        node.score = self.floor + node.hits

    def evicted(self, node: CachedNode, key: float) -> None:
        self.floor = max(self.floor, key)

    def stats(self) -> dict[str, Any]:
        return {"floor": self.floor}
