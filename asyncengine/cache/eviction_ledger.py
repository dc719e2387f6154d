"""What eviction cost: leaves and tokens evicted, and tokens computed again because an eviction
had dropped them (a new leaf whose pages, at the same positions, were evicted before).

A page is remembered by its tokens and its position (not its whole prefix: cheap, and two
prompts that differ before a page and agree on it at the same position are rare), in a bounded
first-in first-out set of ``capacity`` pages, so the count is a lower bound once more pages than
that were evicted since.
"""

from __future__ import annotations

from collections import OrderedDict

from asyncengine.cache.eviction_rule import CachedNode


class EvictionLedger:
    def __init__(self, page_size: int, capacity: int = 1 << 16) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self._gone: OrderedDict[int, None] = OrderedDict()  # page keys evicted, oldest first
        self.evictions = 0  # leaves
        self.evicted_tokens = 0
        self.recomputed_tokens = 0

    def evicted(self, node: CachedNode) -> None:
        self.evictions += 1
        self.evicted_tokens += len(node.key)
        gone = self._gone
        for page in page_keys(node, self.page_size):
            gone[page] = None
        while len(gone) > self.capacity:
            gone.popitem(last=False)

    def stored(self, node: CachedNode) -> None:
        """A new leaf: its pages that were evicted before were computed again."""
        gone = self._gone
        if not gone:
            return
        again = 0
        for page in page_keys(node, self.page_size):
            if page in gone:
                del gone[page]
                again += 1
        self.recomputed_tokens += again * self.page_size

    def counts(self) -> dict[str, int]:
        return {
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "evicted_recomputed_tokens": self.recomputed_tokens,
        }


def page_keys(node: CachedNode, page_size: int) -> list[int]:
    """One number per page of ``node``'s edge, from its tokens and its position."""
    start = node.prefix_len - len(node.key)
    key = node.key
    return [hash((start + i, key[i : i + page_size])) for i in range(0, len(key), page_size)]
