"""RadixCache: matching, insertion, node splits, locks, LRU eviction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.cache import RadixCache
from asyncengine.cache.radix_cache import HEAP_SWEEP_AT
from asyncengine.policies.eviction_registry import make_eviction_rule


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def test_empty_tree_and_empty_sequence() -> None:
    tree = RadixCache(page_size=1)
    found, matched, node = tree.match_prefix([])
    assert found.size == 0 and matched == 0 and node is tree.root
    assert tree.insert([], pages()) == 0
    assert tree.total_size == 0
    assert tree.match_prefix([1, 2])[1] == 0
    assert tree.evict(10).size == 0


def test_insert_reports_present_prefix_and_match_returns_pages() -> None:
    tree = RadixCache(page_size=1)
    assert tree.insert([1, 2, 3, 4], pages(10, 11, 12, 13)) == 0
    assert tree.insert([1, 2, 3, 4, 5], pages(20, 21, 22, 23, 24)) == 4
    found, matched, node = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert matched == 5
    assert found.tolist() == [10, 11, 12, 13, 24]  # the tree keeps its own pages
    assert node.prefix_len == 5
    assert tree.total_size == tree.evictable_size == 5


def test_match_ending_mid_edge_splits_the_node() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3, 4, 5], pages(0, 1, 2, 3, 4))
    assert tree.num_nodes() == 1
    found, matched, node = tree.match_prefix([1, 2, 3, 9])
    assert matched == 3 and found.tolist() == [0, 1, 2]
    assert tree.num_nodes() == 2
    assert node.key == (1, 2, 3)
    (lower,) = node.children.values()
    assert lower.key == (4, 5) and lower.value.tolist() == [3, 4]
    tree.check()
    # A match that ends inside an edge because the query ends there also splits.
    _, matched, node = tree.match_prefix([1, 2])
    assert matched == 2 and node.prefix_len == 2 and tree.num_nodes() == 3
    tree.check()


def test_split_keeps_the_lower_node_and_its_lock() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3, 4], pages(0, 1, 2, 3))
    _, _, leaf = tree.match_prefix([1, 2, 3, 4])
    tree.lock(leaf)
    assert tree.protected_size == 4 and tree.evictable_size == 0
    tree.insert([1, 2, 7], pages(5, 6, 7))  # splits the locked edge after [1, 2]
    assert leaf.prefix_len == 4 and leaf.key == (3, 4)
    assert leaf.parent is not None and leaf.parent.lock_ref == 1
    assert tree.protected_size == 4 and tree.evictable_size == 1
    tree.check()
    tree.unlock(leaf)
    assert tree.protected_size == 0 and tree.evictable_size == 5
    tree.check()


def test_page_aligned_matching_and_short_sequences() -> None:
    tree = RadixCache(page_size=4)
    assert tree.insert([1, 2, 3], pages()) == 0  # shorter than a page: nothing stored
    assert tree.total_size == 0
    assert tree.insert(list(range(10)), pages(7, 8)) == 0  # 2 whole pages, tail dropped
    assert tree.total_size == 8
    found, matched, _ = tree.match_prefix(list(range(10)))
    assert matched == 8 and found.tolist() == [7, 8]
    # Diverging inside the second page matches only the first page, and splits there.
    found, matched, node = tree.match_prefix([0, 1, 2, 3, 4, 5, 99, 7])
    assert matched == 4 and found.tolist() == [7] and node.prefix_len == 4
    assert tree.match_prefix([0, 1, 2])[1] == 0
    assert tree.match_prefix([0, 1, 2, 9])[1] == 0
    tree.check()


def test_insert_needs_enough_pages() -> None:
    tree = RadixCache(page_size=2)
    with pytest.raises(ValueError, match="needs 2 page ids"):
        tree.insert([1, 2, 3, 4], pages(0))


def test_tokens_may_be_tuples_or_arrays() -> None:
    tree = RadixCache(page_size=2)
    tree.insert((1, 2, 3, 4), pages(0, 1))
    assert tree.match_prefix(np.array([1, 2, 3, 4, 5]))[1] == 4
    assert tree.prefix_length((1, 2, 3, 5)) == 2


def test_prefix_length_has_no_side_effects() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], pages(0, 1, 2))
    before = tree.dump()
    assert tree.prefix_length([1, 2, 9]) == 2
    assert tree.prefix_length([1, 2, 3, 4]) == 3
    assert tree.dump() == before


def test_evict_is_lru_over_leaves_and_cascades_to_parents() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], pages(0, 1, 2))
    tree.insert([1, 2, 4], pages(9, 9, 3))
    tree.insert([5, 6], pages(4, 5))
    tree.match_prefix([1, 2, 3])  # [1, 2, 3] is now the most recently used
    assert tree.evict(1).tolist() == [3]  # leaf [4] is the least recently used
    assert tree.evict(1).tolist() == [4, 5]  # then [5, 6], evicted whole
    assert tree.evict(1).tolist() == [2]  # then leaf [3]; its parent [1, 2] is a leaf now
    assert tree.evict(5).tolist() == [0, 1]
    assert tree.total_size == 0 and tree.num_nodes() == 0
    tree.check()


def test_split_touches_only_the_matched_part() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3, 4], pages(0, 1, 2, 3))
    tree.insert([5], pages(4))
    tree.match_prefix([1, 2, 9])  # uses [1, 2] now; [3, 4] stays older than [5]
    assert tree.evict(1).tolist() == [2, 3]
    assert tree.evict(1).tolist() == [4]


def test_evict_more_than_evictable_returns_what_there_is() -> None:
    tree = RadixCache(page_size=2)
    tree.insert([1, 2, 3, 4], pages(0, 1))
    tree.insert([1, 2, 5, 6], pages(0, 2))
    _, _, node = tree.match_prefix([1, 2, 5, 6])
    tree.lock(node)
    freed = tree.evict(100)
    assert freed.tolist() == [1]
    assert tree.evictable_size == 0 and tree.protected_size == 4
    tree.check()


def test_eviction_while_everything_is_locked_frees_nothing() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2], pages(0, 1))
    tree.insert([3], pages(2))
    locked = [tree.match_prefix([1, 2])[2], tree.match_prefix([3])[2]]
    for node in locked:
        tree.lock(node)
    assert tree.evict(3).size == 0
    assert tree.total_size == 3 and tree.evictable_size == 0
    for node in locked:
        tree.unlock(node)
    assert sorted(tree.evict(3).tolist()) == [0, 1, 2]
    tree.check()


def test_locks_count_and_unlock_of_unlocked_raises() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], pages(0, 1, 2))
    _, _, node = tree.match_prefix([1, 2, 3])
    tree.lock(node)
    tree.lock(node)
    tree.unlock(node)
    assert tree.protected_size == 3 and tree.evict(3).size == 0
    tree.unlock(node)
    assert tree.evictable_size == 3
    with pytest.raises(RuntimeError, match="unlock of an unlocked node"):
        tree.unlock(node)
    tree.lock(tree.root)  # the root is always protected: a no-op
    tree.unlock(tree.root)
    tree.check()


def test_touched_leaf_outlives_an_older_one_despite_stale_heap_entries() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1], pages(0))
    tree.insert([2], pages(1))
    for _ in range(3):
        tree.match_prefix([1])  # leaf [1]'s heap entry is now stale
    assert tree.evict(1).tolist() == [1]
    assert tree.evict(1).tolist() == [0]


def test_requeued_entries_do_not_pile_up_in_a_pool_that_never_runs_short() -> None:
    """A rule that requeues every step (queue-aware, as prompts come and go) leaves a stale
    entry each time; with no eviction to pop them the heap must still not grow with steps."""
    tree = RadixCache(page_size=1, rule=make_eviction_rule("queue-aware"))
    tree.insert([1, 2], pages(0, 1))
    tree.insert([1, 2, 5], pages(0, 1, 4))  # [1, 2] is no leaf now: its entry goes stale
    tree.insert([3], pages(2))
    _, _, locked = tree.match_prefix([3])
    tree.lock(locked)
    for _ in range(5 * HEAP_SWEEP_AT):
        tree.rule.watch_waiting([[1, 2], [3]])
        tree.rule.watch_waiting([])
    assert len(tree._heap) <= 2 * HEAP_SWEEP_AT
    tree.check()
    tree.unlock(locked)  # swept out while locked: back in the heap now
    tree.insert([4], pages(3))
    assert tree.evict(1).tolist() == [4]  # least recently used first, as before
    assert tree.evict(2).tolist() == [0, 1]  # a leaf again once its child went
    assert tree.evict(1).tolist() == [2]
    assert tree.evict(1).tolist() == [3]


def test_reset_and_dump() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], pages(0, 1, 2))
    tree.insert([1, 2, 4], pages(0, 1, 3))
    text = tree.dump()
    assert "[1 2]" in text and "[3]" in text and "[4]" in text and "lock_ref=0" in text
    tree.reset()
    assert tree.total_size == 0 and tree.num_nodes() == 0
    assert tree.match_prefix([1, 2])[1] == 0


def brute_force_match(stored: list[list[int]], tokens: list[int], page_size: int) -> int:
    best = 0
    for seq in stored:
        common = 0
        for a, b in zip(seq, tokens, strict=False):
            if a != b:
                break
            common += 1
        best = max(best, common // page_size * page_size)
    return best


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    sequences=st.lists(st.lists(st.integers(0, 2), max_size=24), max_size=12),
    queries=st.lists(st.lists(st.integers(0, 2), max_size=24), max_size=6),
)
def test_match_equals_longest_common_prefix_with_stored_sequences(
    page_size: int, sequences: list[list[int]], queries: list[list[int]]
) -> None:
    tree = RadixCache(page_size)
    stored: list[list[int]] = []
    next_page = 0
    first_page_of: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        num_pages = len(seq) // page_size
        ids = np.arange(next_page, next_page + num_pages, dtype=np.int32)
        next_page += num_pages
        assert tree.insert(seq, ids) == brute_force_match(stored, seq, page_size)
        for i in range(num_pages):
            first_page_of.setdefault(tuple(seq[: (i + 1) * page_size]), int(ids[i]))
        stored.append(seq)
        tree.check()
    for query in queries + sequences:
        expected = brute_force_match(stored, query, page_size)
        assert tree.prefix_length(query) == expected
        found, matched, node = tree.match_prefix(query)
        assert matched == expected and node.prefix_len == expected
        assert found.tolist() == [
            first_page_of[tuple(query[: (i + 1) * page_size])] for i in range(expected // page_size)
        ]
        tree.check()
