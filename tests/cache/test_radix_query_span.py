"""A lookup reads the tokens it matches and one edge more, not its whole query: a request
waiting to be admitted again is looked up every step with its whole context."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.cache import RadixCache, RadixNode
from asyncengine.cache.radix_cache import PrefixEnd

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=24)


class CountingTokens(Sequence[int]):
    """A token sequence that counts the elements read from it."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.read = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            part = self.tokens[index]
            self.read += len(part)
            return part
        self.read += 1
        return self.tokens[index]

    def __iter__(self) -> Iterator[int]:
        for token in self.tokens:
            self.read += 1
            yield token


def tree_with_prefix(page_size: int, cached: list[int]) -> RadixCache:
    tree = RadixCache(page_size)
    tree.insert(cached, np.arange(len(cached) // page_size, dtype=np.int32))
    return tree


@pytest.mark.parametrize("page_size", [1, 4])
def test_each_lookup_reads_the_matched_span_not_the_whole_context(page_size: int) -> None:
    cached = list(range(1, 33))  # 32 tokens: one edge
    context = cached + [7] * 100_000  # a long context whose first 32 tokens are cached
    tree = tree_with_prefix(page_size, cached)
    # what one lookup may read: the cached edge, the first page after it, and a few tokens of
    # the first-token checks
    bound = len(cached) * 3 + page_size + 8
    lookups = {
        "prefix_length": lambda query: tree.prefix_length(query),
        "prefix_and_unlocked": lambda query: tree.prefix_and_unlocked(query)[0],
        "prefix_nodes": lambda query: sum(len(node.key) for node in tree.prefix_nodes(query)),
        "match_prefix": lambda query: tree.match_prefix(query)[1],
    }
    for name, lookup in lookups.items():
        query = CountingTokens(context)
        assert lookup(query) == len(cached), name
        assert query.read <= bound, f"{name} read {query.read} tokens of {len(context)}"


def test_a_query_that_leaves_an_edge_early_reads_only_that_edge() -> None:
    page_size = 4
    cached = list(range(1, 4097))  # one long edge
    tree = tree_with_prefix(page_size, cached)
    query = CountingTokens(cached[:8] + [0] * 50_000)  # leaves the edge after two pages
    assert tree.prefix_length(query) == 8
    assert query.read <= 3 * len(cached)  # the edge's span, compared by a binary search
    _, matched, node = tree.match_prefix(CountingTokens(cached[:8] + [0] * 50_000))
    assert matched == 8 and node.prefix_len == 8
    tree.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_every_kind_of_query_finds_the_same_prefix(page_size: int) -> None:
    cached = list(range(1, 33))
    tree = tree_with_prefix(page_size, cached)
    query = cached[:20] + [99] * 30
    expected = 20 // page_size * page_size
    kinds: list[Sequence[int] | np.ndarray] = [
        query,
        tuple(query),
        np.asarray(query, dtype=np.int64),
        CountingTokens(query),
    ]
    for kind in kinds:
        assert tree.prefix_length(kind) == expected
        assert tree.prefix_and_unlocked(kind) == (expected, expected)
        assert tree.match_prefix(kind)[1] == expected
    tree.check()


def test_an_answer_handed_back_is_kept_while_the_tree_under_it_is_unchanged() -> None:
    page_size = 4
    cached = list(range(1, 33))
    tree = tree_with_prefix(page_size, cached)
    context = cached + [7] * 10_000
    first = tree.prefix_end(context)
    assert first.matched == len(cached)
    # an insert under another first token, a lock and an unlock: this answer holds
    tree.insert([500] * 8, np.arange(100, 102, dtype=np.int32))
    _, _, node = tree.match_prefix(cached[:8] + [0] * 4)  # splits the cached edge
    tree.lock(node)
    query = CountingTokens(context)
    again = tree.prefix_end(query, None, first)
    assert again is first and query.read <= 2  # its first token only: no walk
    assert tree.unlocked_in(again) == len(cached) - 8  # the locked part is not counted
    tree.unlock(node)
    assert tree.unlocked_in(again) == len(cached)
    # an insert under its first token: walked again, and the longer match found
    longer = cached + [7] * 8
    tree.insert(longer, np.arange(200, 210, dtype=np.int32))
    grown = tree.prefix_end(context, None, first)
    assert grown is not first and grown.matched == len(longer)
    # the node it ends in evicted: walked again, and the shorter match found
    tree.evict(tree.evictable_size - len(cached))
    assert tree.prefix_end(context, None, grown).matched == tree.prefix_length(context)
    # emptied: nothing matches
    kept = tree.prefix_end(context)
    tree.reset()
    assert tree.prefix_end(context, None, kept).matched == 0


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "evict", "match", "lock", "unlock", "reset"]), tokens),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2]), steps=ops, query=tokens, end=st.integers(0, 30))
def test_an_answer_handed_back_equals_a_fresh_walk(
    page_size: int, steps: list[tuple[str, list[int]]], query: list[int], end: int
) -> None:
    """After any mix of inserts, evictions, splits, locks and resets, the answer given from the
    last one is the answer of a fresh walk."""
    tree = RadixCache(page_size)
    locked: list[RadixNode] = []
    last = tree.prefix_end(query, end)
    for op, seq in steps:
        if op == "insert":
            n = len(seq) // page_size
            tree.insert(seq, np.arange(n, dtype=np.int32))
        elif op == "evict":
            tree.evict(len(seq))
        elif op == "match":
            locked.append(tree.match_prefix(seq)[2])
            tree.lock(locked[-1])
        elif op == "unlock" and locked:
            tree.unlock(locked.pop())
        elif op == "reset":
            tree.reset()
            locked.clear()
        last = tree.prefix_end(query, end, last)
        fresh = tree.prefix_end(query, end)
        assert last.matched == fresh.matched == tree.prefix_length(query[:end])
        assert tree.unlocked_in(last) == tree.unlocked_in(fresh) == unlocked_along(tree, last)


def unlocked_along(tree: RadixCache, found: PrefixEnd) -> int:
    """The matched tokens in unlocked nodes, summed along the path from the root."""
    total = 0
    for node in tree.prefix_nodes(found_query(found)):
        start = node.prefix_len - len(node.key)
        if node.lock_ref == 0 and start < found.matched:
            total += min(node.prefix_len, found.matched) - start
    return total


def found_query(found: PrefixEnd) -> list[int]:
    """The matched tokens, read back from the path the match ends on."""
    keys: list[tuple[int, ...]] = []
    node: RadixNode | None = found.node
    while node is not None and node.parent is not None:
        keys.append(node.key)
        node = node.parent
    path = [token for key in reversed(keys) for token in key]
    return path[: found.matched]
