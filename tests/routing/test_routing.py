"""Replica routers and the router's prefix tree (pure Python: no Ray, no model)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.routing import (
    CacheAwareRouter,
    LeastLoadedRouter,
    PrefixTree,
    ReplicaState,
    RoundRobinRouter,
    make_router,
)
from asyncengine.routing.prefix_tree import _Node


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_tree(tree: PrefixTree) -> None:
    """Tenancy is closed downwards, counts match the nodes, no empty node lingers."""
    counts: dict[str, int] = {}
    nodes = 0
    stack: list[_Node] = [tree._root]
    while stack:
        node = stack.pop()
        nodes += 1
        if node.parent is not None:
            assert node.tenants, "a node nobody uses must be deleted"
            assert set(node.tenants) <= set(node.parent.tenants)
            assert node.parent.children[node.key[0]] is node
        for replica in node.tenants:
            counts[replica] = counts.get(replica, 0) + len(node.key)
        stack.extend(node.children.values())
    assert nodes == tree.num_nodes
    for replica in tree.replicas:
        assert tree.replica_tokens(replica) == counts.get(replica, 0)


def test_match_gives_each_replica_its_longest_routed_prefix() -> None:
    tree = PrefixTree()
    tree.insert([1, 2, 3, 4, 5], "a", now=0.0)
    tree.insert([1, 2, 3, 9], "b", now=1.0)
    tree.insert([1, 2, 7], "a", now=2.0)
    assert tree.match([1, 2, 3, 4, 5, 6]) == {"a": 5, "b": 3}
    assert tree.match([1, 2, 3, 9, 9]) == {"a": 3, "b": 4}
    assert tree.match([1, 2, 7, 7]) == {"a": 3, "b": 2}
    assert tree.match([5]) == {}
    assert tree.replica_tokens("a") == 6 and tree.replica_tokens("b") == 4
    check_tree(tree)


def test_a_replica_over_its_budget_loses_its_least_recently_used_prefixes() -> None:
    tree = PrefixTree(budget_tokens=25)
    tree.insert(list(range(0, 10)), "a", now=0.0)
    tree.insert(list(range(100, 110)), "a", now=1.0)
    tree.insert(list(range(0, 10)), "a", now=2.0)  # touched again: now the most recent
    tree.insert(list(range(200, 210)), "a", now=3.0)  # 30 tokens > 25: evict to <= 22
    assert tree.replica_tokens("a") <= 25
    assert tree.match(list(range(100, 110))) == {}
    assert tree.match(list(range(0, 10))) == {"a": 10}
    assert tree.match(list(range(200, 210))) == {"a": 10}
    check_tree(tree)


def test_eviction_trims_a_shared_path_from_its_leaves() -> None:
    tree = PrefixTree(budget_tokens=14)
    tree.insert([1] * 8 + [2, 2], "a", now=0.0)
    tree.insert([1] * 8 + [3, 3], "a", now=1.0)
    tree.insert([1] * 8 + [4, 4], "b", now=1.5)
    tree.insert([1] * 8 + [5, 5], "a", now=2.0)  # 14 tokens: at budget, nothing goes
    assert tree.replica_tokens("a") == 14
    tree.insert([1] * 8 + [6, 6], "a", now=3.0)  # 16 > 14: the oldest leaves go first
    assert tree.match([1] * 8 + [2, 2])["a"] == 8
    assert tree.match([1] * 8 + [6, 6])["a"] == 10
    assert tree.match([1] * 8 + [4, 4])["b"] == 10  # another replica's share is untouched
    check_tree(tree)


def test_set_budget_shrinks_a_replica_share_at_once() -> None:
    tree = PrefixTree()
    for i in range(10):
        tree.insert([i] * 10, "a", now=float(i))
    tree.set_budget("a", 50)
    assert tree.replica_tokens("a") <= 50 and tree.budget("a") == 50
    assert tree.match([9] * 10) == {"a": 10} and tree.match([0] * 10) == {}
    check_tree(tree)


def test_entries_past_their_time_to_live_stop_matching_and_are_swept() -> None:
    tree = PrefixTree(ttl_seconds=10.0)
    tree.insert([1, 2, 3, 4], "a", now=0.0)
    tree.insert([1, 2, 5, 6], "b", now=8.0)
    assert tree.match([1, 2, 3, 4], now=9.0) == {"a": 4, "b": 2}
    assert tree.match([1, 2, 3, 4], now=12.0) == {"b": 2}
    assert tree.evict_expired(12.0) == 3  # a's root-to-leaf entries (root, [1,2], [3,4])
    assert tree.replica_tokens("a") == 0
    check_tree(tree)


def test_remove_replica_and_clear() -> None:
    tree = PrefixTree()
    tree.insert([1, 2, 3], "a", now=0.0)
    tree.insert([1, 2, 4], "b", now=0.0)
    tree.remove_replica("a")
    assert tree.match([1, 2, 3]) == {"b": 2} and tree.replicas == ["b"]
    check_tree(tree)
    tree.clear()
    assert tree.match([1, 2, 4]) == {} and tree.num_nodes == 1
    check_tree(tree)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.sampled_from("abc")),
        min_size=1,
        max_size=40,
    ),
    st.integers(4, 60),
)
def test_tree_stays_consistent_and_bounded(ops: list[tuple[list[int], str]], budget: int) -> None:
    tree = PrefixTree(budget_tokens=budget)
    unbounded = PrefixTree()
    routed: dict[str, list[list[int]]] = {}
    for now, (tokens, replica) in enumerate(ops):
        tree.insert(tokens, replica, float(now))
        unbounded.insert(tokens, replica, float(now))
        routed.setdefault(replica, []).append(tokens)
        check_tree(tree)
        assert tree.replica_tokens(replica) <= max(budget, len(tokens))
    for probe, _ in ops:
        expected = {r: max(lcp(probe, t) for t in ts) for r, ts in routed.items()}
        assert unbounded.match(probe) == {r: n for r, n in expected.items() if n > 0}
        for r, n in tree.match(probe).items():  # a bounded tree only forgets
            assert n <= expected[r]


def states(*loads: int, ids: str = "ab") -> list[ReplicaState]:
    return [ReplicaState(i, load) for i, load in zip(ids, loads, strict=True)]


def test_cache_aware_keeps_a_prefix_group_on_one_replica_and_spreads_groups() -> None:
    router = CacheAwareRouter()
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000) for _ in range(64)] for _ in range(6)]
    owner: dict[int, str] = {}
    for step in range(60):
        group = rng.randrange(6)
        tokens = prefixes[group] + [rng.randrange(1000) for _ in range(8)]
        decision = router.route(tokens, states(0, 0), now=float(step))
        if group in owner:
            assert decision.replica_id == owner[group] and decision.reason == "prefix"
            assert decision.matched_tokens >= 64
        else:
            assert decision.reason == "least_cached"
            owner[group] = decision.replica_id
    assert sorted(owner.values()).count("a") == 3  # six prefixes spread three and three
    assert router.decisions["prefix"] == 54 and router.decisions["least_cached"] == 6


def test_cache_aware_load_guard_sends_to_the_idlest_when_loads_diverge() -> None:
    router = CacheAwareRouter(balance_abs_threshold=4, balance_rel_threshold=1.5)
    tokens = list(range(40))
    assert router.route(tokens, states(0, 0), 0.0).replica_id == "a"
    # a's load is within the thresholds: the prefix wins
    assert router.route(tokens, states(4, 0), 1.0) == router.route(tokens, states(4, 0), 1.0)
    assert router.route(tokens, states(4, 0), 2.0).reason == "prefix"
    guarded = router.route(tokens, states(9, 2), 3.0)
    assert (guarded.replica_id, guarded.reason) == ("b", "load_guard")
    # both thresholds must be passed: 20 vs 14 is 6 apart but not 1.5x
    assert router.route(tokens, states(20, 14), 4.0).reason == "prefix"


def test_cache_aware_threshold_is_a_share_of_the_prompt() -> None:
    router = CacheAwareRouter(cache_threshold=0.5)
    router.route(list(range(10)), states(0, 0), 0.0)  # -> a
    short_share = router.route(list(range(10)) + list(range(100, 130)), states(0, 0), 1.0)
    assert short_share.reason == "least_cached" and short_share.replica_id == "b"
    long_share = router.route(list(range(10)) + [7], states(0, 0), 2.0)
    assert (long_share.reason, long_share.replica_id, long_share.matched_tokens) == (
        "prefix",
        "a",
        10,
    )


def test_cache_aware_bounds_a_replica_by_its_reported_cache_and_forgets_dead_ones() -> None:
    router = CacheAwareRouter()
    replicas = [ReplicaState("a", 0, cache_tokens=100), ReplicaState("b", 0, cache_tokens=100)]
    for i in range(20):
        router.route([i] * 30, replicas, float(i))
    assert router.tree.replica_tokens("a") <= 100 and router.tree.replica_tokens("b") <= 100
    router.forget("a")
    assert "a" not in router.tree.replicas
    router.reset()
    assert router.tree_stats()["nodes"] == 1


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobinRouter()
    picks = [rr.route([1], states(5, 0, 0, ids="cab"), 0.0).replica_id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    ll = LeastLoadedRouter()
    assert ll.route([1], states(3, 1, 1, ids="abc"), 0.0).replica_id == "b"
    assert ll.route([1], states(3, 1, 1, ids="abc"), 0.0).replica_id == "c"  # ties take turns
    assert ll.route([1], states(3, 1, 1, ids="abc"), 0.0).replica_id == "b"
    assert ll.decisions == {"least_loaded": 3}


def test_make_router_by_name() -> None:
    assert isinstance(make_router("cache-aware", cache_threshold=0.1), CacheAwareRouter)
    with pytest.raises(ValueError, match="unknown router 'random'"):
        make_router("random")
    with pytest.raises(ValueError, match="no replica"):
        make_router("round-robin").route([1], [], 0.0)


def test_make_router_refuses_unknown_options_and_text_for_numbers() -> None:
    with pytest.raises(ValueError, match="router 'round-robin' has no option 'x'.*none"):
        make_router("round-robin", x=1)
    with pytest.raises(ValueError, match="balance_abs_threshold must be a number, got '3'"):
        make_router("kv-events", balance_abs_threshold="3")
    with pytest.raises(ValueError, match="ttl_seconds must be a number, got True"):
        make_router("cache-aware", ttl_seconds=True)
    assert isinstance(make_router("cache-aware", ttl_seconds=None), CacheAwareRouter)
