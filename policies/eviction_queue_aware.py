"""``queue-aware``: LRU, except that the pages a waiting request's prompt matches go last.

Every step the scheduler hands over the prompts waiting (the first ``window`` in line); the
nodes each prompt's cached prefix runs through are marked wanted (the path up from where its
match ends; that end is asked again of the tree with last step's answer, which holds without a
walk while the tree under the prompt is unchanged, so a step costs the paths' nodes, not the
prompts' tokens), and a wanted leaf's key is its
access time plus a constant larger than any time, so that it is evicted only when nothing
unwanted is left. A node no longer wanted takes its plain LRU place again (``tree.requeue``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncengine.cache.eviction_rule import CachedNode, EvictionRule, EvictionTree
from asyncengine.cache.radix_cache import PrefixEnd

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
        # id(prompt) -> the prompt (kept, so its id names no other) and where its match ended
        self.ends: dict[int, tuple[Sequence[int], PrefixEnd]] = {}
        self.protected_evictions = 0  # wanted leaves evicted all the same (nothing else left)

    def bind(self, tree: EvictionTree) -> None:
        super().bind(tree)
        self.wanted = {}
        self.ends = {}

    def key(self, node: CachedNode) -> float:
        return node.last_access + (WANTED if id(node) in self.wanted else 0.0)

    def watch_waiting(self, prompts: Sequence[Sequence[int]]) -> None:
        wanted: dict[int, CachedNode] = {}
        ends: dict[int, tuple[Sequence[int], PrefixEnd]] = {}
        for prompt in prompts[: self.window]:
            if len(prompt) < self.tree.page_size:
                continue
            seen = self.ends.get(id(prompt))
            last = seen[1] if seen is not None and seen[0] is prompt else None
            found = self.tree.prefix_end(prompt, None, last)
            ends[id(prompt)] = (prompt, found)
            node = found.node
            while node.parent is not None:  # up to the root, which is never evicted
                wanted[id(node)] = node
                node = node.parent
        before, self.wanted, self.ends = self.wanted, wanted, ends
        for ident, node in before.items():
            if ident not in wanted:
                self.tree.requeue(node)

    def evicted(self, node: CachedNode, key: float) -> None:
        if self.wanted.pop(id(node), None) is not None:
            self.protected_evictions += 1

    def stats(self) -> dict[str, Any]:
        return {"wanted_nodes": len(self.wanted), "wanted_evicted": self.protected_evictions}
