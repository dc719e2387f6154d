"""The finite-pool hit bounds against exhaustive search on tiny traces."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.bench.optimal_hit_finite import _trie, optimal_hit_finite


def brute_force(prompts: list[list[int]], page_size: int, pool: int) -> int:
    """Best hits in the given order over every choice of cached pages that the radix tree can
    hold (a prefix tree: a page only with its parent)."""
    parsed, _ = _trie(prompts, page_size)
    parent: dict[int, int] = {}
    for p in parsed:
        for above, node in zip([-1, *p.path], p.path, strict=False):
            parent[node] = above

    @cache
    def best(i: int, state: frozenset[int]) -> int:
        if i == len(parsed):
            return 0
        p = parsed[i]
        if p.need > pool:
            return best(i + 1, state)
        own = set(p.path)
        options = sorted(state)
        result = 0
        for r in range(len(options) + 1):
            for keep in itertools.combinations(options, r):
                kept = set(keep)
                if len(kept - own) > pool - p.need:
                    continue
                if any(parent[node] != -1 and parent[node] not in kept for node in kept):
                    continue  # not a prefix tree
                matched = 0
                for node in p.path[: p.matchable]:
                    if node not in kept:
                        break
                    matched += 1
                result = max(result, matched * page_size + best(i + 1, frozenset(kept | own)))
        return result

    return best(0, frozenset())


tiny_prompts = st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=6), min_size=1, max_size=5)


@settings(max_examples=120, deadline=None)
@given(tiny_prompts, st.sampled_from([1, 2]), st.integers(1, 4))
def test_arrival_order_bound_is_the_exhaustive_optimum(
    prompts: list[list[int]], page_size: int, pool: int
) -> None:
    bound = optimal_hit_finite(prompts, page_size, pool, order="arrival")
    assert bound.hit_tokens == brute_force(prompts, page_size, pool)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=5), min_size=1, max_size=4),
    st.sampled_from([1, 2]),
    st.integers(1, 3),
)
def test_any_order_bound_is_the_best_order_of_the_exhaustive_optimum(
    prompts: list[list[int]], page_size: int, pool: int
) -> None:
    best = max(
        brute_force([prompts[i] for i in order], page_size, pool)
        for order in itertools.permutations(range(len(prompts)))
    )
    assert optimal_hit_finite(prompts, page_size, pool, order="any").hit_tokens == best


def test_a_pool_that_holds_the_longest_prompt_reaches_the_infinite_bound() -> None:
    groups = [[g * 10 + k for k in range(8)] for g in range(4)]  # four 8-token prefixes
    prompts = [groups[i % 4] + [100 + i, 200 + i] for i in range(16)]  # interleaved
    infinite = optimal_hit(prompts, page_size=2)
    assert optimal_hit_finite(prompts, 2, pool_pages=5, order="any") == infinite
    # in arrival order a pool of one prefix thrashes: every prompt misses
    assert optimal_hit_finite(prompts, 2, pool_pages=5, order="arrival").hit_tokens == 0
    # a pool of all four prefixes (and a running prompt) keeps every prefix
    roomy = optimal_hit_finite(prompts, 2, pool_pages=4 * 4 + 5, order="arrival")
    assert roomy.hit_tokens == infinite.hit_tokens
    # in between, Belady keeps some prefixes rather than none (LRU would keep none)
    middle = optimal_hit_finite(prompts, 2, pool_pages=2 * 4 + 5, order="arrival")
    assert 0 < middle.hit_tokens < infinite.hit_tokens


def test_prompts_longer_than_the_pool_hit_nothing_and_count_in_the_total() -> None:
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], [9, 9]]
    bound = optimal_hit_finite(prompts, 1, pool_pages=6, order="any")
    assert bound.prompt_tokens == 15 and bound.hit_tokens == 0
    with pytest.raises(ValueError):
        optimal_hit_finite(prompts, 1, pool_pages=0)
    with pytest.raises(ValueError):
        optimal_hit_finite(prompts, 1, pool_pages=4, order="lru")  # type: ignore[arg-type]
