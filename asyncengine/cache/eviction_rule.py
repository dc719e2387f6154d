"""EvictionRule: which of the radix tree's evictable leaves goes first.

The tree (radix_cache.py) keeps its unlocked leaves in one heap keyed by ``key(node)``, lowest
first, so an eviction costs O(log n) per leaf whatever the rule. Keys are checked lazily when a
leaf reaches the top: a leaf whose key rose since it was pushed goes back in at its new key; a
rule whose key can fall for a reason other than an eviction (queue-aware: a waiting request no
longer wants the page) calls ``tree.requeue(node)``, which pushes a fresh entry. A rule reads
what the tree keeps on every node (``last_access``, ``hits``, ``prefix_len``, ``len(key)``) and
may keep one number of its own there (``node.score``, set in ``touch``).

The base class is LRU (the key is the access time). A rule of one's own subclasses it and is
named like a policy (``--eviction-policy my_rule.py:MyRule``; policies/eviction_registry.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class CachedNode(Protocol):
    """What a rule reads of a tree node (cache/radix_cache.py ``RadixNode``)."""

    key: tuple[int, ...]  # the edge's tokens
    prefix_len: int  # tokens from the root to the end of the edge
    last_access: int  # the tree's clock at its last match or insert
    hits: int  # matches and inserts that went through it
    score: float  # the rule's own number
    lock_ref: int


class EvictionSpill(Protocol):
    """Hears every leaf the tree evicts, before it leaves (cache/host_tier.py)."""

    def store(self, node: Any) -> None: ...


class EvictionTree(Protocol):
    """What a rule may ask of the tree (cache/radix_cache.py ``RadixCache``)."""

    page_size: int

    def requeue(self, node: Any) -> None: ...

    def prefix_nodes(self, tokens: Sequence[int]) -> list[Any]: ...

    def prefix_end(self, tokens: Sequence[int], end: int | None, last: Any) -> Any: ...


class EvictionRule:
    """Least recently used first (the default). Override ``key`` (and ``touch``/``evicted``).

    ``name`` is what stats, metrics and reports call the rule: a subclass that sets none is
    called by its class name (not its base's, which would count its evictions as another's)."""

    name = "lru"
    # the tree calls touch() for every node a match or an insert stamps (off: no call at all)
    touches = False
    # the scheduler hands the waiting queue's prompts to watch_waiting() every step
    watches_queue = False
    queue_window = 64  # how many waiting requests, oldest first, it is handed
    # key(node) is exactly node.last_access: the tree reads it without calling key()
    plain_lru = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def bind(self, tree: EvictionTree) -> None:
        """The tree this rule orders (called before any other method; again on a reset)."""
        self.tree = tree

    def key(self, node: CachedNode) -> float:
        """Lower keys are evicted first."""
        return float(node.last_access)

    def touch(self, node: CachedNode) -> None:
        """``node`` was just matched or inserted (``last_access`` and ``hits`` are updated)."""

    def evicted(self, node: CachedNode, key: float) -> None:
        """``node`` left the tree at ``key`` (aging rules raise their floor here)."""

    def watch_waiting(self, prompts: Sequence[Sequence[int]]) -> None:
        """The prompts of the requests waiting now, first in line first (``watches_queue``)."""

    def stats(self) -> dict[str, Any]:
        """Rule-specific figures for ``engine.stats()`` (numbers only)."""
        return {}


class LeastRecentlyUsed(EvictionRule):
    """``lru``: the leaf used longest ago goes first (the tree reads the time directly)."""

    name = "lru"
    plain_lru = True
