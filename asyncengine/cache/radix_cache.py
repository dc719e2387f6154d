"""RadixCache: a prefix tree over token ids whose edges hold the KV page ids of their tokens.

Invariants the code keeps:
- Page aligned: every edge holds a whole number of pages (``len(key) % page_size == 0``), and
  ``value`` holds ``len(key) // page_size`` page ids. Children are keyed by the first token of
  their edge (page_size 1) or the tuple of its first page of tokens.
- ``lock_ref`` of a node counts the locks held on it or any node below it (a lock walks up to
  the root), so a locked node's ancestors are locked too, and every unlocked node can be reached
  by repeatedly evicting unlocked leaves.
- ``evictable_size`` (tokens in unlocked nodes) and ``protected_size`` (tokens in locked nodes)
  are kept incrementally; their sum is the tree's size.
- Every unlocked leaf has a live entry in ``_heap`` (its id is the node's ``heap_id``), keyed by
  the eviction rule (cache/eviction_rule.py; LRU: the access time). Entries are lazy: one may be
  stale (the node got children, a lock, a higher key, or was removed) and is checked when
  popped; a key that rose is re-pushed at the node's current key, so the order stays exact for
  keys that only rise. ``requeue`` pushes a fresh entry for a key that fell, and the old one,
  no longer the node's ``heap_id``, is dropped when popped. Stale entries that no eviction pops
  (a pool that never runs short, a rule that requeues every step) are dropped when the heap
  reaches twice its size after the last such sweep: the heap stays within a constant factor of
  the evictable leaves, at O(1) amortised per push.

Tokens are held as tuples (edge keys are tuple slices of the inserted sequence) and compared
with slices at C speed; where an edge and a query diverge, the divergence point is found by a
binary search over slice equality, not a per-token loop. A query is never copied whole: each
edge is compared with the span of the query it covers (``_span``), so a lookup reads the tokens
it matches and one edge more, however long the query (a waiting request's whole context).

``_root_heads`` counts the root's children by the first token of their edge, so that
``prefix_length`` answers a query whose first token starts no cached edge (the common case
for a scheduler scoring a long queue) without copying the query into a tuple.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from asyncengine.cache.eviction_ledger import EvictionLedger
from asyncengine.cache.eviction_rule import EvictionRule, EvictionSpill, LeastRecentlyUsed
from asyncengine.cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    page_hashes,
)
from asyncengine.common.cache_salt import lora_id_of_key

_EMPTY_PAGES = np.empty(0, dtype=np.int32)
# the heap's entries before stale ones are first swept out (RadixCache._sweep_heap)
HEAP_SWEEP_AT = 1024

# counters of inserts by first token (RadixCache.head_inserts): every token of a vocabulary up
# to this size has its own; salted first tokens share them (a shared counter moves more often,
# which only makes a remembered prefix length be looked up again)
HEAD_BUCKETS = 1 << 16


def head_bucket(first_token: int) -> int:
    """The counter of RadixCache.head_inserts that inserts starting with ``first_token`` move."""
    return first_token % HEAD_BUCKETS


class RadixNode:
    __slots__ = (
        "children",
        "hashes",
        "heap_id",
        "hits",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "prefix_len",
        "score",
        "value",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        value: np.ndarray,
        parent: RadixNode | None,
        prefix_len: int,
        last_access: int,
        lock_ref: int = 0,
    ) -> None:
        self.children: dict[object, RadixNode] = {}
        self.parent = parent
        self.key = key  # the edge's tokens, from the parent to this node
        self.value = value  # int32 page ids of the edge's tokens
        self.prefix_len = prefix_len  # tokens from the root to the end of this node's edge
        self.lock_ref = lock_ref
        self.last_access = last_access
        self.heap_id = -1  # the id of its live heap entry (-1: none)
        self.hits = 1  # matches and inserts that went through it
        self.score = 0.0  # the eviction rule's own number (cache/eviction_rule.py)
        self.hashes: tuple[int, ...] = ()  # the edge's page hashes, when events are kept

    def __repr__(self) -> str:
        head = self.key[:6]
        more = "..." if len(self.key) > 6 else ""
        return (
            f"RadixNode(key={head}{more} len={len(self.key)}, pages={len(self.value)}, "
            f"lock_ref={self.lock_ref}, prefix_len={self.prefix_len})"
        )


def _as_token_tuple(tokens: Sequence[int] | np.ndarray) -> tuple[int, ...]:
    # Tuples, not lists: the garbage collector stops tracking a tuple of ints, so a tree of
    # millions of tokens adds nothing to every collection's traversal.
    if type(tokens) is list:
        return tuple(tokens)
    if type(tokens) is tuple:
        return tokens
    if isinstance(tokens, np.ndarray):
        return tuple(tokens.tolist())
    return tuple(tokens)


def _span(tokens: Sequence[int] | np.ndarray, start: int, stop: int) -> tuple[int, ...]:
    """``tokens[start:stop]`` as a tuple (what edge keys are), copying only that span."""
    if type(tokens) is tuple:
        return tokens[start:stop]
    if isinstance(tokens, np.ndarray):
        return tuple(tokens[start:stop].tolist())
    return tuple(tokens[start:stop])


@dataclass(slots=True)
class PrefixEnd:
    """Where a query's cached prefix ended (RadixCache.prefix_end): a caller that asks again
    about the same tokens, as a waiting request's admission does every step, hands it back and
    is answered without a walk while the tree under the query is unchanged."""

    end: int  # the page-aligned end of the query that was asked about
    epoch: int  # head_epoch of the query's first token then
    resets: int  # RadixCache.resets then
    node: RadixNode  # the node whose edge holds the match's end (the root: nothing matched)
    matched: int  # tokens matched


class RadixCache:
    def __init__(
        self, page_size: int = 1, events: bool = False, rule: EvictionRule | None = None
    ) -> None:
        """``events``: keep page hashes and record every page stored and removed and every
        reset (cache/kv_events.py), for ``drain_events``. ``rule``: which evictable leaf goes
        first (default LRU)."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._clock = itertools.count(1)
        self._heap_ids = itertools.count()
        self._events: list[KVEvent] | None = None
        # inserts so far by the first token of what they inserted (head_epoch): only an insert
        # starting with a sequence's first token can make its prefix_length grow (evictions and
        # resets only shrink answers), so an answer holds while that count stays the same.
        # Never cleared: a count seen before a reset must not come back after it. Keyed by
        # head_bucket, as salted first tokens are as many as the salts clients send
        self.head_inserts: dict[int, int] = {}
        self.inserts = 0  # all of them (never cleared either): the same, nothing grew
        self.resets = 0  # how many times the tree was emptied (PrefixEnd: a walk to trust)
        # what eviction cost (evictions, tokens computed again): off for a bare tree, the KV
        # manager turns it on (it hashes every evicted page)
        self.ledger: EvictionLedger | None = None
        # hears every leaf evicted, still attached (the host tier copies its pages out)
        self.spill: EvictionSpill | None = None
        self.rule: EvictionRule = LeastRecentlyUsed()
        self._plain_lru = True
        self._touches = False
        self.reset()
        self.set_rule(rule if rule is not None else LeastRecentlyUsed())
        self._events = [] if events else None

    def record_events(self) -> None:
        """Start keeping events (an empty tree only: its pages have no hashes yet)."""
        if self.root.children:
            raise RuntimeError("events can only be turned on while the tree is empty")
        if self._events is None:
            self._events = []

    def record(self, event: KVEvent) -> None:
        """Keep an event of a tier below the tree (host_tier.py) with the tree's own."""
        if self._events is not None:
            self._events.append(event)

    def drain_events(self) -> list[KVEvent]:
        """The events since the last drain (empty when events are off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # ----------------------------------------------------------------------------- state

    def reset(self) -> None:
        """Forget every node (the caller owns the pages they held)."""
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        self.resets += 1
        self.root = RadixNode((), _EMPTY_PAGES, None, 0, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self._heap: list[tuple[float, int, RadixNode]] = []
        self._sweep_at = HEAP_SWEEP_AT
        self._root_heads: dict[object, int] = {}  # first token of a root child's edge -> count
        self._evictable_size = 0
        self._protected_size = 0
        self.rule.bind(self)  # a rule's marks on the old nodes go with them

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (all of them can be evicted)."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens in nodes locked by live requests."""
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def _child_key(self, edge: tuple[int, ...]) -> object:
        """The key its parent files the node of ``edge`` under: its first token or page."""
        if self.page_size == 1:
            return edge[0]
        return edge[: self.page_size]

    def _common_length(
        self, edge: tuple[int, ...], tokens: tuple[int, ...], pos: int, end: int
    ) -> int:
        """Length of the common page-aligned prefix of ``edge`` and ``tokens[pos:end]``.

        The caller knows the first page matches (it selected the child by it)."""
        ps = self.page_size
        limit = min(len(edge), end - pos) // ps  # in pages
        if edge[: limit * ps] == tokens[pos : pos + limit * ps]:
            return limit * ps
        low, high = 1, limit  # pages: edge[:low*ps] matches, edge[:high*ps] does not
        while high - low > 1:
            mid = (low + high) // 2
            if edge[: mid * ps] == tokens[pos : pos + mid * ps]:
                low = mid
            else:
                high = mid
        return low * ps

    def _edge_match(
        self, edge: tuple[int, ...], tokens: Sequence[int] | np.ndarray, pos: int, end: int
    ) -> int:
        """How many tokens of ``edge`` the query ``tokens[pos:end]`` matches, page aligned (the
        caller selected the edge by its first page); reads only the span the edge covers."""
        length = len(edge)
        span = _span(tokens, pos, min(end, pos + length))
        if len(span) == length and span == edge:
            return length
        return self._common_length(edge, span, 0, len(span))

    def _split(self, node: RadixNode, length: int) -> RadixNode:
        """Cut ``node``'s edge after ``length`` tokens; returns the new upper node.

        ``node`` keeps its identity as the lower part, so locks held on it stay valid."""
        parent = node.parent
        assert parent is not None
        upper = RadixNode(
            node.key[:length],
            node.value[: length // self.page_size],
            parent,
            parent.prefix_len + length,
            node.last_access,
            node.lock_ref,
        )
        upper.hits = node.hits
        upper.score = node.score
        parent.children[self._child_key(node.key)] = upper
        if node.hashes:
            pages = length // self.page_size
            upper.hashes, node.hashes = node.hashes[:pages], node.hashes[pages:]
        node.key = node.key[length:]
        node.value = node.value[length // self.page_size :]
        node.parent = upper
        upper.children[self._child_key(node.key)] = node
        return upper

    def _drop_root_head(self, head: object) -> None:
        count = self._root_heads[head] - 1
        if count:
            self._root_heads[head] = count
        else:
            del self._root_heads[head]

    def _push(self, node: RadixNode) -> None:
        entry = next(self._heap_ids)
        node.heap_id = entry
        key = float(node.last_access) if self._plain_lru else self.rule.key(node)
        heapq.heappush(self._heap, (key, entry, node))
        if len(self._heap) > self._sweep_at:
            self._sweep_heap()

    def _sweep_heap(self) -> None:
        """Drop the entries a pop would drop (superseded, or of a node that is no longer an
        evictable leaf: it is pushed again when it becomes one), in place (``_evict`` holds
        the list)."""
        heap = self._heap
        kept: list[tuple[float, int, RadixNode]] = []
        for item in heap:
            node = item[2]
            if item[1] != node.heap_id:
                continue
            if node.parent is None or node.lock_ref > 0 or node.children:
                node.heap_id = -1
                continue
            kept.append(item)
        heap[:] = kept
        heapq.heapify(heap)
        self._sweep_at = max(HEAP_SWEEP_AT, 2 * len(heap))

    def requeue(self, node: RadixNode) -> None:
        """``node``'s key fell (the rule says so): an evictable leaf, or a node whose entry
        is still in the heap, takes its new place now."""
        if node.parent is None:
            return
        if node.heap_id >= 0 or (node.lock_ref == 0 and not node.children):
            self._push(node)

    def set_rule(self, rule: EvictionRule) -> None:
        """Order evictions by ``rule`` from now on (the heap is rebuilt: O(n log n) once)."""
        rule.bind(self)
        self.rule = rule
        self._plain_lru = rule.plain_lru
        self._touches = rule.touches
        self._heap = []
        self._sweep_at = HEAP_SWEEP_AT
        for node in self.iter_nodes():
            node.heap_id = -1
            if self._touches:
                rule.touch(node)
        for node in self.iter_nodes():
            if node.lock_ref == 0 and not node.children:
                self._push(node)

    def _stored(self, leaf: RadixNode, parent: RadixNode) -> None:
        """Hash a new leaf's pages after its parent's last one, and record them stored."""
        assert self._events is not None
        previous = parent.hashes[-1] if parent.hashes else None
        leaf.hashes = tuple(page_hashes(leaf.key, self.page_size, previous))
        head = leaf
        while head.parent is not None and head.parent is not self.root:
            head = head.parent
        lora = lora_id_of_key(int(head.key[0])) if head.key else None
        self._events.append(
            BlockStored(list(leaf.hashes), previous, list(leaf.key), self.page_size, lora, None)
        )

    # ----------------------------------------------------------------------------- queries

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, end: int | None = None
    ) -> tuple[np.ndarray, int, RadixNode]:
        """Longest cached page-aligned prefix of ``tokens[:end]`` (without copying the slice).

        Returns (page ids, number of tokens matched, the node where the match ends). Splits a
        node whose edge the match ends in, so the returned node ends exactly at the match (and
        can be locked), and touches the access time of exactly the matched nodes."""
        ps = self.page_size
        tick = next(self._clock)
        node = self.root
        node.last_access = tick
        end = len(tokens) if end is None else min(end, len(tokens))
        end -= end % ps
        if end == 0 or tokens[0] not in self._root_heads:
            return _EMPTY_PAGES, 0, node  # no edge starts with it (without the tuple copy)
        pos = 0
        chunks: list[np.ndarray] = []
        touches = self._touches
        while pos < end:
            child = node.children.get(tokens[pos] if ps == 1 else _span(tokens, pos, pos + ps))
            if child is None:
                break
            length = self._edge_match(child.key, tokens, pos, end)
            if length < len(child.key):
                child = self._split(child, length)
            child.last_access = tick
            child.hits += 1
            if touches:
                self.rule.touch(child)
            chunks.append(child.value)
            pos += length
            node = child
        if not chunks:
            return _EMPTY_PAGES, 0, node
        pages = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        return pages, pos, node

    def head_epoch(self, first_token: int) -> int:
        """Changes whenever an insert may have made the prefix length of a sequence that starts
        with ``first_token`` grow (head_inserts)."""
        return self.head_inserts.get(head_bucket(first_token), 0)

    def prefix_length(self, tokens: Sequence[int] | np.ndarray, end: int | None = None) -> int:
        """Length of the cached page-aligned prefix of ``tokens[:end]``; no side effects."""
        return self.prefix_end(tokens, end).matched

    def prefix_and_unlocked(
        self, tokens: Sequence[int] | np.ndarray, end: int | None = None
    ) -> tuple[int, int]:
        """``prefix_length(tokens, end)`` and how many of those tokens no lock protects: what
        locking the match's end would take out of ``evictable_size``; no side effects."""
        found = self.prefix_end(tokens, end)
        return found.matched, self.unlocked_in(found)

    def prefix_end(
        self,
        tokens: Sequence[int] | np.ndarray,
        end: int | None = None,
        last: PrefixEnd | None = None,
    ) -> PrefixEnd:
        """Where the cached page-aligned prefix of ``tokens[:end]`` ends; no side effects.

        ``last``: this answer for the same tokens at an earlier time. It is given back without
        a walk while it holds: nothing was inserted under the tokens' first token since
        (head_epoch), the tree was not reset, and the node it ends in is still in the tree and
        still holds its end (evictions take leaves only, so the path to it is whole)."""
        ps = self.page_size
        end = len(tokens) if end is None else min(end, len(tokens))
        end -= end % ps
        epoch = self.head_epoch(int(tokens[0])) if end else 0
        if last is not None and last.end == end and last.epoch == epoch and self._holds(last):
            return last
        node = self.root
        pos = 0
        if end and tokens[0] in self._root_heads:
            while pos < end:
                child = node.children.get(tokens[pos] if ps == 1 else _span(tokens, pos, pos + ps))
                if child is None:
                    break
                length = self._edge_match(child.key, tokens, pos, end)
                node = child
                pos += length
                if length < len(child.key):
                    break  # the match ends inside this edge
        return PrefixEnd(end, epoch, self.resets, node, pos)

    def _holds(self, found: PrefixEnd) -> bool:
        """``found`` is still the answer of its walk (prefix_end says when it may be asked)."""
        if found.resets != self.resets:
            return False
        node = found.node
        if node is self.root:
            return True  # nothing matched; nothing inserted under its first token since
        return node.parent is not None and node.prefix_len - len(node.key) < found.matched

    def unlocked_in(self, found: PrefixEnd) -> int:
        """How many tokens of the prefix ``found`` no lock protects (prefix_and_unlocked): the
        unlocked nodes are the deep end of its path, as a lock walks up to the root."""
        node = found.node
        part = found.matched - (node.prefix_len - len(node.key))
        unlocked = 0
        while node.lock_ref == 0 and node.parent is not None:
            unlocked += part  # a part matched keeps its node's lock count when split
            node = node.parent
            part = len(node.key)
        return unlocked

    def prefix_nodes(self, tokens: Sequence[int] | np.ndarray) -> list[RadixNode]:
        """The nodes the cached prefix of ``tokens`` runs through, root first (the last one
        may match only part of its edge); no side effects."""
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        nodes: list[RadixNode] = []
        if end == 0 or tokens[0] not in self._root_heads:
            return nodes
        node = self.root
        pos = 0
        while pos < end:
            child = node.children.get(tokens[pos] if ps == 1 else _span(tokens, pos, pos + ps))
            if child is None:
                break
            nodes.append(child)
            length = len(child.key)
            if pos + length > end or _span(tokens, pos, pos + length) != child.key:
                break
            pos += length
            node = child
        return nodes

    # ----------------------------------------------------------------------------- updates

    def insert(self, tokens: Sequence[int] | np.ndarray, pages: np.ndarray | Sequence[int]) -> int:
        """Insert the whole pages of ``tokens`` with their page ids.

        Returns how many leading tokens the tree already held; the tree keeps its own pages for
        them, so the caller should free its duplicates for that range. Like match_prefix, it
        splits where the tokens leave an edge and touches exactly the nodes they cover."""
        return self.insert_at(tokens, pages)[0]

    def insert_at(
        self,
        tokens: Sequence[int] | np.ndarray,
        pages: np.ndarray | Sequence[int],
        start: RadixNode | None = None,
    ) -> tuple[int, RadixNode]:
        """``insert``, and the node that ends exactly at the inserted whole pages (the one
        ``match_prefix`` of those tokens would return next: no walk again to lock it).

        ``start``: a node in the tree whose path from the root spells the first
        ``start.prefix_len`` of ``tokens`` (a sequence's locked node): the walk goes on from
        there, stamping it and its ancestors as the walk down to it would, without comparing
        the tokens on the way."""
        key = _as_token_tuple(tokens)
        if key:
            head_inserts = self.head_inserts
            bucket = head_bucket(key[0])
            head_inserts[bucket] = head_inserts.get(bucket, 0) + 1
            self.inserts += 1
        ps = self.page_size
        end = len(key) - len(key) % ps
        # a list (a sequence's pages) is converted only where a new leaf takes its pages: most
        # of an insert is usually present already (a prompt cached when its prefill ended)
        page_list = pages if type(pages) is list else None
        page_ids = _EMPTY_PAGES if page_list is not None else np.asarray(pages, dtype=np.int32)
        if page_list is not None:
            if len(page_list) < end // ps:
                raise ValueError(
                    f"insert of {end} tokens needs {end // ps} page ids, got {len(page_list)}"
                )
        elif page_ids.ndim != 1 or page_ids.size < end // ps:
            raise ValueError(
                f"insert of {end} tokens needs {end // ps} page ids, got shape {page_ids.shape}"
            )
        tick = next(self._clock)
        node = self.root
        node.last_access = tick
        pos = 0
        if start is not None and start is not node and start.prefix_len <= end:
            node, pos = start, start.prefix_len
            above: RadixNode | None = start
            while above is not None and above is not self.root:
                above.last_access = tick
                above.hits += 1
                if self._touches:
                    self.rule.touch(above)
                above = above.parent
        while pos < end:
            child_key = key[pos] if ps == 1 else key[pos : pos + ps]
            child = node.children.get(child_key)
            if child is None:
                leaf = RadixNode(
                    key[pos:end],
                    page_ids[pos // ps : end // ps].copy()
                    if page_list is None
                    else np.array(page_list[pos // ps : end // ps], dtype=np.int32),
                    node,
                    node.prefix_len + end - pos,
                    tick,
                )
                node.children[child_key] = leaf
                if self._events is not None:
                    self._stored(leaf, node)
                if self.ledger is not None:
                    self.ledger.stored(leaf)
                if self._touches:
                    self.rule.touch(leaf)
                if node is self.root:
                    head = key[0]
                    self._root_heads[head] = self._root_heads.get(head, 0) + 1
                self._evictable_size += end - pos
                self._push(leaf)
                return pos, leaf
            edge = child.key
            length = len(edge)
            if key[pos : pos + length] != edge:
                length = self._common_length(edge, key, pos, end)
                child = self._split(child, length)
            child.last_access = tick
            child.hits += 1
            if self._touches:
                self.rule.touch(child)
            pos += length
            node = child
        return end, node

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (counted; pair with unlock)."""
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                size = len(node.key)
                self._evictable_size -= size
                self._protected_size += size
            node.lock_ref += 1
            parent = node.parent
            assert parent is not None, "lock of a node that is no longer in the tree"
            node = parent

    def unlock(self, node: RadixNode) -> None:
        root = self.root
        while node is not root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                size = len(node.key)
                self._protected_size -= size
                self._evictable_size += size
                if not node.children and node.heap_id < 0:
                    self._push(node)
            parent = node.parent
            assert parent is not None, "unlock of a node that is no longer in the tree"
            node = parent

    def evict(self, num_tokens: int) -> np.ndarray:
        """Evict unlocked leaves, lowest eviction key first (LRU: least recently used), until at least ``num_tokens``
        tokens are freed or nothing evictable is left; returns the freed page ids."""
        freed = self._evict(num_tokens)
        if not freed:
            empty: np.ndarray = _EMPTY_PAGES.copy()
            return empty
        pages: np.ndarray = np.concatenate(freed)
        return pages

    def evict_ids(self, num_tokens: int) -> list[int]:
        """``evict``, the freed page ids as a list of ints (for the free list)."""
        ids: list[int] = []
        for value in self._evict(num_tokens):
            ids += value.tolist()
        return ids

    def _evict(self, num_tokens: int) -> list[np.ndarray]:
        freed: list[np.ndarray] = []
        count = 0
        heap = self._heap
        root = self.root
        plain_lru = self._plain_lru
        spill, ledger = self.spill, self.ledger
        # nodes whose key rose once in this call: a rule whose key rises at every read (one
        # of time) would take its place again forever; the second time it goes
        repushed: set[int] = set()
        while count < num_tokens and heap:
            stamp, entry, node = heapq.heappop(heap)
            if entry != node.heap_id:
                continue  # superseded by a fresher entry (requeue), or the node left
            node.heap_id = -1
            parent = node.parent
            if parent is None or node.lock_ref > 0 or node.children:
                continue  # removed, locked or no longer a leaf: re-pushed when that changes
            key = float(node.last_access) if plain_lru else self.rule.key(node)
            if key > stamp and id(node) not in repushed:
                repushed.add(id(node))
                self._push(node)  # its key rose since it was pushed: take its place again
                continue
            if spill is not None:
                spill.store(node)
            del parent.children[self._child_key(node.key)]
            if parent is root:
                self._drop_root_head(node.key[0])
            node.parent = None
            size = len(node.key)
            self._evictable_size -= size
            count += size
            freed.append(node.value)
            if self._events is not None:
                self._events.append(BlockRemoved(list(node.hashes), None))
            if ledger is not None:
                ledger.evicted(node)
            if not plain_lru:
                self.rule.evicted(node, key)
            if parent is not root and not parent.children and parent.lock_ref == 0:
                if parent.heap_id < 0:
                    self._push(parent)
        return freed

    # ----------------------------------------------------------------------------- inspection

    def iter_nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_nodes(self) -> int:
        return sum(1 for _ in self.iter_nodes())

    def all_pages(self) -> np.ndarray:
        values = [node.value for node in self.iter_nodes()]
        return np.concatenate(values) if values else _EMPTY_PAGES.copy()

    def path_pages(self, node: RadixNode) -> np.ndarray:
        """Page ids from the root down to the end of ``node``."""
        values = []
        root = self.root
        while node is not root:
            values.append(node.value)
            parent = node.parent
            assert parent is not None, "node is no longer in the tree"
            node = parent
        values.reverse()
        return np.concatenate(values) if values else _EMPTY_PAGES.copy()

    def check(self) -> None:
        """Assert the tree's structural invariants (sizes, alignment, keys, heap coverage)."""
        ps = self.page_size
        evictable = protected = 0
        for node in self.iter_nodes():
            parent = node.parent
            assert parent is not None, f"{node!r} has no parent"
            assert parent.children.get(self._child_key(node.key)) is node, (
                f"{node!r} is not its parent's child under its first key"
            )
            assert node.key and len(node.key) % ps == 0, f"{node!r}: edge not page aligned"
            assert len(node.value) == len(node.key) // ps, f"{node!r}: pages do not match key"
            assert node.prefix_len == parent.prefix_len + len(node.key), (
                f"{node!r}: prefix_len {node.prefix_len} != parent's "
                f"{parent.prefix_len} + {len(node.key)}"
            )
            assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
            if parent is not self.root:
                assert parent.lock_ref >= node.lock_ref, (
                    f"{node!r}: lock_ref above its parent's {parent.lock_ref}"
                )
            if node.lock_ref == 0:
                evictable += len(node.key)
                if not node.children:
                    assert node.heap_id >= 0, f"evictable leaf {node!r} is missing from the heap"
            else:
                protected += len(node.key)
        assert evictable == self._evictable_size, (
            f"evictable_size {self._evictable_size} != recount {evictable}"
        )
        assert protected == self._protected_size, (
            f"protected_size {self._protected_size} != recount {protected}"
        )
        heads: dict[object, int] = {}
        for child in self.root.children.values():
            heads[child.key[0]] = heads.get(child.key[0], 0) + 1
        assert heads == self._root_heads, "root head counts do not match the root's children"

    def dump(self) -> str:
        """The tree as indented text: one line per node."""
        lines = [
            f"RadixCache(page_size={self.page_size}, evictable={self._evictable_size}, "
            f"protected={self._protected_size})"
        ]
        stack: list[tuple[RadixNode, int]] = [
            (child, 1) for child in reversed(list(self.root.children.values()))
        ]
        while stack:
            node, depth = stack.pop()
            head = " ".join(str(t) for t in node.key[:8])
            more = f" ... ({len(node.key)} tokens)" if len(node.key) > 8 else ""
            pages = node.value[:8].tolist()
            pages_more = "..." if len(node.value) > 8 else ""
            lines.append(
                f"{'  ' * depth}[{head}{more}] pages={pages}{pages_more} "
                f"lock_ref={node.lock_ref} t={node.last_access}"
            )
            stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
        return "\n".join(lines)
