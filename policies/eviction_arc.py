"""``arc``: Adaptive Replacement Cache (Megiddo and Modha 2003) over the tree's leaves.

ARC splits the cache between pages seen once lately (recency, its list T1) and pages seen
again (frequency, T2), and moves the split by ghost hits: a page coming back soon after it was
evicted from T1 says recency deserved more room, one evicted from T2 says frequency did. The
tree evicts from one heap of leaves, so the split is a key: a leaf's last access time, plus a
``bonus`` (in ticks of the tree's clock) when it was used ``frequent_hits`` times or more; a
ghost hit from T1 lowers the bonus, one from T2 raises it, by ARC's ratio of the ghost lists'
sizes; a leaf keeps the bonus of its last use. The ghosts are page keys (tokens and position) of the last ``ghost_pages`` pages each list
evicted."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from asyncengine.cache.eviction_ledger import page_keys
from asyncengine.cache.eviction_rule import CachedNode, EvictionRule


class AdaptiveReplacement(EvictionRule):
    name = "arc"
    touches = True

    def __init__(
        self,
        frequent_hits: int = 3,
        bonus: float = 1024.0,
        step: float = 64.0,
        max_bonus: float = float(1 << 20),
        ghost_pages: int = 1 << 14,
    ) -> None:
        """``frequent_hits``: uses that put a leaf in the frequent list (a request's match and
        its insert are two); ``bonus``: the frequent list's start advantage, in ticks; ``step``:
        how far one ghost hit moves it (times ARC's ratio)."""
        if frequent_hits < 2 or step <= 0 or bonus < 0 or max_bonus < bonus or ghost_pages < 1:
            raise ValueError(
                "arc needs frequent_hits >= 2, step > 0, 0 <= bonus <= max_bonus, ghost_pages >= 1"
            )
        self.frequent_hits = frequent_hits
        self.bonus = bonus
        self.step = step
        self.max_bonus = max_bonus
        self.ghost_pages = ghost_pages
        self.recent_ghosts: OrderedDict[int, None] = OrderedDict()  # B1
        self.frequent_ghosts: OrderedDict[int, None] = OrderedDict()  # B2
        self.ghost_hits = [0, 0]

    def key(self, node: CachedNode) -> float:
        return node.score

    def touch(self, node: CachedNode) -> None:
        # the bonus at the last use: a key changes only when its node is used, so the heap's
        # order stays exact while the bonus moves
        before = node.score
        frequent = node.hits >= self.frequent_hits
        node.score = node.last_access + (self.bonus if frequent else 0.0)
        if node.score < before:
            self.tree.requeue(node)
        if node.hits == 1:
            self._ghost_hit(node)  # only a new leaf can be a ghost coming back

    def _ghost_hit(self, node: CachedNode) -> None:
        if not self.recent_ghosts and not self.frequent_ghosts:
            return  # nothing evicted yet (a fresh rule, as a live swap makes): no key to hash
        ps = self.tree.page_size
        for page in page_keys(node, ps):
            if page in self.recent_ghosts:
                del self.recent_ghosts[page]
                ratio = max(1.0, len(self.frequent_ghosts) / max(1, len(self.recent_ghosts)))
                self.bonus = max(0.0, self.bonus - self.step * ratio)
                self.ghost_hits[0] += 1
                return
            if page in self.frequent_ghosts:
                del self.frequent_ghosts[page]
                ratio = max(1.0, len(self.recent_ghosts) / max(1, len(self.frequent_ghosts)))
                self.bonus = min(self.max_bonus, self.bonus + self.step * ratio)
                self.ghost_hits[1] += 1
                return

    def evicted(self, node: CachedNode, key: float) -> None:
        frequent = node.hits >= self.frequent_hits
        ghosts = self.frequent_ghosts if frequent else self.recent_ghosts
        for page in page_keys(node, self.tree.page_size):
            ghosts[page] = None
        while len(ghosts) > self.ghost_pages:
            ghosts.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        return {
            "bonus": self.bonus,
            "recent_ghost_hits": self.ghost_hits[0],
            "frequent_ghost_hits": self.ghost_hits[1],
        }
