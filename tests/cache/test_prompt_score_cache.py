"""PromptScoreCache (cache/prompt_scores.py): scored pages keyed by their prefix, the page after
it and k; what it knows, what it gives back, what it keeps and what it evicts."""

from __future__ import annotations

import pytest

from asyncengine.cache.prompt_scores import PromptScoreCache
from asyncengine.common.plan import TokenLogprobs

PS = 4


def scores_of(prompt: list[int], first: int, last: int) -> list[TokenLogprobs]:
    """Made-up scores of positions first .. last - 1, each telling its position and tokens."""
    return [
        TokenLogprobs(-float(p) - prompt[p + 1] / 1000, [(prompt[p], -0.5)])
        for p in range(first, last)
    ]


def test_pages_are_kept_whole_and_given_back_from_any_position() -> None:
    cache = PromptScoreCache(PS, max_pages=16)
    prompt = list(range(100, 114))  # positions 0..12 score a token: pages 0, 1, 2 whole
    scores = scores_of(prompt, 0, 13)
    cache.store(prompt, 0, scores, before=0, top_k=1)
    assert len(cache) == 3 and cache.stored_pages == 3
    assert cache.known_until(prompt, 0, 1) == 12
    assert cache.known_until(prompt, 5, 1) == 12
    assert cache.take(prompt, 5, 12, 1) == scores[5:12]
    assert cache.hit_positions == 7
    assert cache.known_until(prompt, 12, 1) == 12  # the last page is not whole
    assert cache.known_until(prompt, 0, 2) == 0  # other alternatives asked: not known


def test_a_page_depends_on_its_prefix_and_on_the_next_token() -> None:
    cache = PromptScoreCache(PS, max_pages=16)
    prompt = list(range(100, 114))
    cache.store(prompt, 0, scores_of(prompt, 0, 13), before=0, top_k=1)
    other_next = prompt[:8] + [7] + prompt[9:]  # page 1's last position scores another token
    assert cache.known_until(other_next, 0, 1) == 4
    other_prefix = [1] + prompt[1:]
    assert cache.known_until(other_prefix, 0, 1) == 0
    assert cache.known_until(prompt[:9], 0, 1) == 8  # page 1 scores token 8, still there


def test_only_pages_scored_whole_and_new_ones_are_stored() -> None:
    cache = PromptScoreCache(PS, max_pages=16)
    prompt = list(range(200, 220))
    # a request scoring from position 2: page 0 is scored in part, never kept
    cache.store(prompt, 2, scores_of(prompt, 2, 9), before=0, top_k=0)
    assert cache.stored_pages == 1 and cache.known_until(prompt, 4, 0) == 8
    assert cache.known_until(prompt, 2, 0) == 2
    # a later chunk completes page 2 only
    cache.store(prompt, 2, scores_of(prompt, 2, 14), before=7, top_k=0)
    assert cache.stored_pages == 2 and cache.known_until(prompt, 4, 0) == 12


def test_least_recently_used_pages_go_first() -> None:
    cache = PromptScoreCache(PS, max_pages=2)
    a, b = list(range(10, 16)), list(range(20, 26))
    cache.store(a, 0, scores_of(a, 0, 5), before=0, top_k=1)
    cache.store(b, 0, scores_of(b, 0, 5), before=0, top_k=1)
    cache.take(a, 0, 4, 1)  # a is the recent one now
    c = list(range(30, 36))
    cache.store(c, 0, scores_of(c, 0, 5), before=0, top_k=1)
    assert cache.evicted_pages == 1 and len(cache) == 2
    assert cache.known_until(b, 0, 1) == 0
    assert cache.known_until(a, 0, 1) == cache.known_until(c, 0, 1) == 4
    cache.clear()
    assert len(cache) == 0 and cache.known_until(a, 0, 1) == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pages"):
        PromptScoreCache(PS, max_pages=0)
