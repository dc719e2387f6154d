"""RadixCache.prefix_length: the query walk without side effects, with and without ``end``."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.cache import RadixCache

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=24)


def brute_force_prefix(cached: list[list[int]], query: list[int], page_size: int) -> int:
    """The longest page-aligned prefix of ``query`` that some cached sequence starts with."""
    best = 0
    for seq in cached:
        n = 0
        limit = min(len(seq), len(query)) // page_size * page_size
        while n < limit and seq[n : n + page_size] == query[n : n + page_size]:
            n += page_size
        best = max(best, n)
    return best


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    inserted=st.lists(tokens, max_size=6),
    evict_tokens=st.integers(0, 40),
    query=tokens,
    end=st.integers(0, 30),
)
def test_prefix_length_matches_a_brute_force_walk(
    page_size: int, inserted: list[list[int]], evict_tokens: int, query: list[int], end: int
) -> None:
    tree = RadixCache(page_size)
    next_page = 0
    for seq in inserted:
        n = len(seq) // page_size
        tree.insert(seq, np.arange(next_page, next_page + n, dtype=np.int32))
        next_page += n
    tree.evict(evict_tokens)
    tree.check()  # includes the root's first-token index after inserts and evictions
    # what is left: every root-to-leaf path, as token lists
    paths: list[list[int]] = []
    stack: list[tuple[object, list[int]]] = [(tree.root, [])]
    while stack:
        node, prefix = stack.pop()
        children = list(node.children.values())  # type: ignore[attr-defined]
        if not children:
            paths.append(prefix)
        stack.extend((child, prefix + list(child.key)) for child in children)
    expected = brute_force_prefix(paths, query, page_size)
    assert tree.prefix_length(query) == expected
    assert tree.prefix_length(tuple(query)) == expected
    assert tree.prefix_length(np.asarray(query, dtype=np.int64)) == expected
    assert tree.prefix_length(query, end) == brute_force_prefix(paths, query[:end], page_size)
    before = tree.dump()
    tree.prefix_length(query, end)
    assert tree.dump() == before  # no splits, no access-time changes
