"""``queue-aware``: LRU, except that the pages a waiting request's prompt matches go last.

Every step the scheduler hands over the prompts waiting (the first ``window`` in line); the
nodes each prompt's cached prefix runs through are marked wanted, and a wanted leaf's key is its
access time plus a constant larger than any time, so that it is evicted only when nothing
unwanted is left. A node no longer wanted takes its plain LRU place again (``tree.requeue``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncengine.cache.eviction_rule import CachedNode, EvictionRule, EvictionTree

WANTED = float(1 << 52)  # above any access time the tree's clock reaches


class QueueAware(EvictionRule):
    name = "queue-aware"
    watches_queue = True

    def __init__(self, window: int = 64) -> None:
        """``window``: how many waiting requests, first in line first, protect their pages."""
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self.queue_window = window
        self.wanted: dict[int, CachedNode] = {}  # id(node) -> node
        self.protected_evictions = 0  # wanted leaves evicted all the same (nothing else left)

    def bind(self, tree: EvictionTree) -> None:
        super().bind(tree)
        self.wanted = {}

    def key(self, node: CachedNode) -> float:
        return node.last_access + (WANTED if id(node) in self.wanted else 0.0)

    def watch_waiting(self, prompts: Sequence[Sequence[int]]) -> None:
        wanted: dict[int, CachedNode] = {}
        for prompt in prompts[: self.window]:
            for node in self.tree.prefix_nodes(prompt):
                wanted[id(node)] = node
        before, self.wanted = self.wanted, wanted
        for ident, node in before.items():
            if ident not in wanted:
                self.tree.requeue(node)

    def evicted(self, node: CachedNode, key: float) -> None:
        if self.wanted.pop(id(node), None) is not None:
            self.protected_evictions += 1

    def stats(self) -> dict[str, Any]:
        return {"wanted_nodes": len(self.wanted), "wanted_evicted": self.protected_evictions}
