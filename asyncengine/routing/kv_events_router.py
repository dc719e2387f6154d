"""KV-events routing: route on what each replica's cache holds, as its KV events say.

Cache-aware routing guesses a replica's cache from where the router sent prompts (a prefix tree
with a size budget); this router reads the truth: each replica publishes the pages its radix
cache stores and evicts (cache/kv_events.py), and ``observe`` applies them. A prompt's match on
a replica is the leading run of its page hashes (``page_hashes``, the same chain the replicas
compute) that the replica holds. Between routing a prompt and the events of its prefill there
is a lag, so pages routed to a replica count as held there until its events report them or
``pending_seconds`` pass (otherwise a burst of one new prefix would scatter over the replicas).
The decision rule is cache-aware's: the load guard, then the longest match when it covers
``cache_threshold`` of the prompt; then, where no replica holds enough of it (the prefix was
evicted everywhere, or is new), the replica its longest prefix was last routed to ("affinity":
a prefix keeps one home instead of being computed on every replica), else the replica holding
the fewest pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from asyncengine.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from asyncengine.cache.kv_events import page_hashes as chained_page_hashes
from asyncengine.routing.base import ReplicaRouter, ReplicaState, RouteDecision
from asyncengine.routing.prefix_rule import PrefixRule


class _ReplicaBlocks:
    """One replica's pages as its events report them, and the pages routed there not yet
    reported (hash -> when that guess expires)."""

    __slots__ = ("held", "pending")

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.pending: dict[int, float] = {}

    def holds(self, block: int, now: float) -> bool:
        if block in self.held:
            return True
        expiry = self.pending.get(block)
        if expiry is None:
            return False
        if expiry < now:
            del self.pending[block]
            return False
        return True


class KVEventsRouter(ReplicaRouter):
    name = "kv-events"
    consumes_kv_events = True

    def __init__(
        self,
        page_size: int = 16,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        pending_seconds: float = 30.0,
        max_affinity_pages: int = 1 << 20,
    ) -> None:
        super().__init__()
        self.rule = PrefixRule(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self.page_size = page_size
        self.pending_seconds = pending_seconds
        self.replicas: dict[str, _ReplicaBlocks] = {}
        self.events_applied = 0
        # page hash -> the replica a prompt with that page was last routed to (LRU-bounded)
        self.affinity: OrderedDict[int, str] = OrderedDict()
        self.max_affinity_pages = max_affinity_pages

    def observe(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        """Apply what ``replica_id``'s cache published."""
        blocks = self.replicas.setdefault(replica_id, _ReplicaBlocks())
        for event in events:
            self.events_applied += 1
            if isinstance(event, BlockStored):
                if event.block_size != self.page_size:
                    raise ValueError(
                        f"replica {replica_id} pages hold {event.block_size} tokens; this "
                        f"router was made for {self.page_size}"
                    )
                blocks.held.update(event.block_hashes)
                for block in event.block_hashes:
                    blocks.pending.pop(block, None)
            elif isinstance(event, BlockRemoved):
                blocks.held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks.held.clear()
                blocks.pending.clear()

    def _matched_pages(self, hashes: list[int], replica_id: str, now: float) -> int:
        blocks = self.replicas.get(replica_id)
        if blocks is None:
            return 0
        for i, block in enumerate(hashes):
            if not blocks.holds(block, now):
                return i
        return len(hashes)

    def _choose(
        self, tokens: Sequence[int], replicas: list[ReplicaState], now: float
    ) -> RouteDecision:
        ps = self.page_size
        hashes = chained_page_hashes(tokens, ps)
        matched = {
            r.replica_id: self._matched_pages(hashes, r.replica_id, now) * ps for r in replicas
        }
        if self.rule.imbalanced(replicas):
            chosen = min(replicas, key=lambda r: (r.load, self._size(r.replica_id)))
            reason = "load_guard"
        else:
            best = max(replicas, key=lambda r: (matched[r.replica_id], -r.load))
            best_len = matched[best.replica_id]
            home = self._home(hashes, {r.replica_id for r in replicas})
            if self.rule.covers(best_len, len(tokens)):
                chosen, reason = best, "prefix"
            elif home is not None:
                chosen = next(r for r in replicas if r.replica_id == home)
                reason = "affinity"
            else:
                chosen = min(replicas, key=lambda r: (self._size(r.replica_id), r.load))
                reason = "least_cached"
        self._remember(hashes, chosen.replica_id)
        blocks = self.replicas.setdefault(chosen.replica_id, _ReplicaBlocks())
        expiry = now + self.pending_seconds
        for block in hashes:
            if block not in blocks.held:
                blocks.pending[block] = expiry
        return RouteDecision(chosen.replica_id, reason, matched[chosen.replica_id])

    def _home(self, hashes: list[int], live: set[str]) -> str | None:
        """The replica the prompt's longest prefix was last routed to, if it is still live."""
        affinity = self.affinity
        home = None
        for block in hashes:
            replica = affinity.get(block)
            if replica is None:
                break
            home = replica
        return home if home in live else None

    def _remember(self, hashes: list[int], replica_id: str) -> None:
        affinity = self.affinity
        for block in hashes:
            affinity[block] = replica_id
            affinity.move_to_end(block)
        while len(affinity) > self.max_affinity_pages:
            affinity.popitem(last=False)

    def _size(self, replica_id: str) -> int:
        blocks = self.replicas.get(replica_id)
        return 0 if blocks is None else len(blocks.held) + len(blocks.pending)

    def forget(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def reset(self) -> None:
        self.replicas.clear()
        self.affinity.clear()

    def tree_stats(self) -> dict[str, int]:
        """Tokens each replica's events say it holds (``tokens:<id>``, as the cache-aware
        router's tree reports them) and pages routed there not yet reported."""
        ps = self.page_size
        return {
            **{f"tokens:{r}": len(b.held) * ps for r, b in self.replicas.items()},
            **{f"pending:{r}": len(b.pending) for r, b in self.replicas.items()},
        }
