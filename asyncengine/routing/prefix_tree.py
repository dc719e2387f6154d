"""PrefixTree: the router's approximate radix tree of the token prefixes sent to each replica.

One tree over token ids is shared by all replicas ("tenants"): every node records, for each
replica whose requests went through it, when that replica last used it. A replica's tenancy is
closed downwards (a replica present at a node is present at all its ancestors), so the deepest
node of a path where a replica is present gives the prefix that replica most likely holds.

The tree only approximates the replicas' real caches (they evict by their own LRU), so it is
kept bounded the same way: each replica's share (the tokens of the nodes it is present at) has
a budget and loses its least recently used leaves beyond it, and with ``ttl_seconds`` a
replica's entries older than that are dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

DEFAULT_REPLICA_BUDGET_TOKENS = 1 << 20
# eviction goes this far below a replica's budget, so that it runs once per many inserts
LOW_WATER = 0.9


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple[int, ...]  # the edge's tokens, from the parent
    parent: _Node | None
    serial: int  # creation order: breaks eviction ties the same way on every run
    children: dict[int, _Node] = field(default_factory=dict)
    tenants: dict[str, float] = field(default_factory=dict)  # replica -> last use


def _common_prefix(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """How many leading tokens of ``key`` equal ``tokens[start:]`` (C-speed slice compares)."""
    limit = min(len(key), len(tokens) - start)
    if key[:limit] == tokens[start : start + limit]:
        return limit
    lo, hi = 0, limit  # key[:lo] matches, key[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[:mid] == tokens[start : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    """Token prefixes routed to each replica, bounded per replica by an LRU token budget and
    an optional time to live."""

    def __init__(
        self,
        budget_tokens: int = DEFAULT_REPLICA_BUDGET_TOKENS,
        ttl_seconds: float | None = None,
    ) -> None:
        if budget_tokens < 1:
            raise ValueError("budget_tokens must be >= 1")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be > 0 (or None: no time limit)")
        self.default_budget = budget_tokens
        self.ttl = ttl_seconds
        self._serial = 0
        self._root = self._new_node((), None)
        self._tokens: dict[str, int] = {}  # replica -> tokens of the nodes it is present at
        self._budgets: dict[str, int] = {}  # replicas whose own cache size is known
        self._nodes = 1
        self._last_sweep = 0.0

    # -- queries ----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], now: float | None = None) -> dict[str, int]:
        """For each replica, the length of the longest prefix of ``tokens`` routed to it (entries
        past their time to live do not count)."""
        key = tuple(tokens)
        horizon = None if self.ttl is None or now is None else now - self.ttl
        matched: dict[str, int] = {}
        node, depth = self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            k = _common_prefix(child.key, key, depth)
            depth += k
            for replica, last in child.tenants.items():
                if horizon is None or last >= horizon:
                    matched[replica] = depth
            if k < len(child.key):
                break
            node = child
        return matched

    def replica_tokens(self, replica: str) -> int:
        return self._tokens.get(replica, 0)

    def budget(self, replica: str) -> int:
        return self._budgets.get(replica, self.default_budget)

    @property
    def num_nodes(self) -> int:
        return self._nodes

    @property
    def replicas(self) -> list[str]:
        return sorted(self._tokens)

    # -- updates ----------------------------------------------------------------------------
    def set_budget(self, replica: str, tokens: int) -> None:
        """Bound ``replica``'s share by its real cache size (tokens), as the replica reports it."""
        if tokens < 1:
            raise ValueError("a replica's budget must be >= 1 token")
        self._budgets[replica] = tokens
        if self._tokens.get(replica, 0) > tokens:
            self._evict(replica, int(tokens * LOW_WATER))

    def insert(self, tokens: Sequence[int], replica: str, now: float) -> None:
        """Record that ``tokens`` went to ``replica`` at ``now``."""
        key = tuple(tokens)
        counts = self._tokens
        counts.setdefault(replica, 0)
        node = self._root
        node.tenants[replica] = now
        depth = 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = self._new_node(key[depth:], node, {replica: now})
                node.children[key[depth]] = child
                self._nodes += 1
                counts[replica] += len(child.key)
                break
            k = _common_prefix(child.key, key, depth)
            if k < len(child.key):
                child = self._split(child, k)
            if replica not in child.tenants:
                counts[replica] += len(child.key)
            child.tenants[replica] = now
            node = child
            depth += k
        if counts[replica] > self.budget(replica):
            self._evict(replica, int(self.budget(replica) * LOW_WATER))
        if self.ttl is not None and now - self._last_sweep >= self.ttl / 8:
            self.evict_expired(now)

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica`` (it died or left)."""
        for node in list(self._walk()):
            if node.tenants.pop(replica, None) is not None and not node.tenants:
                self._delete(node)
        self._tokens.pop(replica, None)
        self._budgets.pop(replica, None)

    def clear(self) -> None:
        """Forget every prefix (the replicas flushed their caches); budgets stay."""
        self._root = self._new_node((), None)
        self._tokens = dict.fromkeys(self._tokens, 0)
        self._nodes = 1

    def evict_expired(self, now: float) -> int:
        """Drop every replica entry last used more than ``ttl_seconds`` ago; returns how many."""
        self._last_sweep = now
        if self.ttl is None:
            return 0
        horizon = now - self.ttl
        dropped = 0
        # Children before parents: a replica's timestamps never grow down a path, so its
        # expired entries are whole subtrees and dropping them keeps tenancy closed downwards.
        for node in reversed(list(self._walk())):
            for replica in [r for r, last in node.tenants.items() if last < horizon]:
                del node.tenants[replica]
                self._tokens[replica] -= len(node.key)
                dropped += 1
            if not node.tenants and node is not self._root:
                self._delete(node)
        return dropped

    # -- internals --------------------------------------------------------------------------
    def _walk(self) -> Iterator[_Node]:
        """Every node, parents before children."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _new_node(
        self, key: tuple[int, ...], parent: _Node | None, tenants: dict[str, float] | None = None
    ) -> _Node:
        self._serial += 1
        return _Node(key, parent, self._serial, tenants=tenants or {})

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = self._new_node(child.key[:k], parent, dict(child.tenants))
        child.key = child.key[k:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        self._nodes += 1
        return upper

    def _delete(self, node: _Node) -> None:
        parent = node.parent
        if parent is None or node.children:
            return
        del parent.children[node.key[0]]
        self._nodes -= 1

    def _is_leaf_of(self, node: _Node, replica: str) -> bool:
        return replica in node.tenants and not any(
            replica in c.tenants for c in node.children.values()
        )

    def _evict(self, replica: str, target: int) -> None:
        """Drop ``replica``'s least recently used leaves until its share is at most ``target``."""
        heap = [
            (node.tenants[replica], node.serial, node)
            for node in self._walk()
            if node is not self._root and self._is_leaf_of(node, replica)
        ]
        heapq.heapify(heap)
        counts = self._tokens
        while heap and counts[replica] > target:
            _, _, node = heapq.heappop(heap)
            del node.tenants[replica]
            counts[replica] -= len(node.key)
            parent = node.parent
            if not node.tenants:
                self._delete(node)
            if (
                parent is not None
                and parent is not self._root
                and self._is_leaf_of(parent, replica)
            ):
                heapq.heappush(heap, (parent.tenants[replica], parent.serial, parent))
