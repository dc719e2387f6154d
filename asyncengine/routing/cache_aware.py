"""Cache-aware routing: send a prompt where its prefix most likely is, unless loads diverge.

The policy of SGLang's router, on token ids (PrefixTree): when the busiest replica has more
than ``balance_abs_threshold`` requests more than the idlest and more than
``balance_rel_threshold`` times as many, the idlest wins (load_guard). Otherwise the replica
whose routed prefixes match the prompt longest wins when the match covers at least
``cache_threshold`` of the prompt (prefix); else the replica holding the fewest tokens takes the
new prefix (least_cached), which spreads distinct prefixes evenly over the replicas' caches.
A replica that reports its real cache size bounds its share of the tree to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncengine.routing.base import ReplicaRouter, ReplicaState, RouteDecision
from asyncengine.routing.prefix_rule import PrefixRule
from asyncengine.routing.prefix_tree import DEFAULT_REPLICA_BUDGET_TOKENS, PrefixTree


class CacheAwareRouter(ReplicaRouter):
    name = "cache-aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = DEFAULT_REPLICA_BUDGET_TOKENS,
        ttl_seconds: float | None = 3600.0,
    ) -> None:
        super().__init__()
        self.rule = PrefixRule(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self.tree = PrefixTree(max_tree_tokens, ttl_seconds)

    def _choose(
        self, tokens: Sequence[int], replicas: list[ReplicaState], now: float
    ) -> RouteDecision:
        tree = self.tree
        for r in replicas:
            if r.cache_tokens and r.cache_tokens != tree.budget(r.replica_id):
                tree.set_budget(r.replica_id, r.cache_tokens)
        matched = tree.match(tokens, now)
        if self.rule.imbalanced(replicas):
            chosen = min(replicas, key=lambda r: (r.load, tree.replica_tokens(r.replica_id)))
            reason = "load_guard"
        else:
            best = max(replicas, key=lambda r: (matched.get(r.replica_id, 0), -r.load))
            best_len = matched.get(best.replica_id, 0)
            if self.rule.covers(best_len, len(tokens)):
                chosen, reason = best, "prefix"
            else:
                chosen = min(replicas, key=lambda r: (tree.replica_tokens(r.replica_id), r.load))
                reason = "least_cached"
        tree.insert(tokens, chosen.replica_id, now)
        return RouteDecision(chosen.replica_id, reason, matched.get(chosen.replica_id, 0))

    def forget(self, replica_id: str) -> None:
        self.tree.remove_replica(replica_id)

    def reset(self) -> None:
        self.tree.clear()

    def tree_stats(self) -> dict[str, int]:
        tree = self.tree
        return {
            "nodes": tree.num_nodes,
            **{f"tokens:{r}": tree.replica_tokens(r) for r in tree.replicas},
        }
