from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.bench import (
    LatencyStats,
    RequestRecord,
    optimal_hit,
    percentile_of_sorted,
    percentiles,
    summarize,
)
from asyncengine.bench.records import inter_token_gaps

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    ours = percentile_of_sorted(sorted(values), q)
    theirs = float(np.percentile(values, q, method="linear"))
    assert math.isclose(ours, theirs, rel_tol=1e-9, abs_tol=1e-9)


def test_percentiles_hand_checked() -> None:
    assert percentiles([4.0, 1.0, 3.0, 2.0], [0, 50, 90, 100]) == pytest.approx(
        [1.0, 2.5, 3.7, 4.0]
    )
    assert percentiles([7.0], [50, 99]) == [7.0, 7.0]
    assert all(math.isnan(v) for v in percentiles([], [50]))
    with pytest.raises(ValueError):
        percentile_of_sorted([1.0], 101)


def test_latency_stats() -> None:
    stats = LatencyStats.of(np.arange(101, dtype=float))
    assert (stats.count, stats.mean, stats.p50, stats.p90, stats.p99, stats.max) == (
        101,
        50.0,
        50.0,
        90.0,
        99.0,
        100.0,
    )
    assert LatencyStats.of([]).count == 0 and math.isnan(LatencyStats.of([]).p50)


def test_summary_hand_made_run() -> None:
    records = [
        RequestRecord("a", 0.0, 10, token_times=[1.0, 1.5, 2.5], finish_time=2.5, cached_tokens=4),
        RequestRecord("b", 1.0, 30, token_times=[2.0, 3.0], finish_time=3.0, retracts=2),
        RequestRecord("c", 2.0, 5, token_times=[3.0], finish_time=4.0, cached_tokens=1),
        RequestRecord("d", 2.0, 8, failed=True, finish_time=2.2),
    ]
    s = summarize(records)
    assert (s.num_requests, s.num_completed, s.num_failed, s.retracts) == (4, 3, 1, 2)
    assert s.duration == 4.0
    assert s.request_throughput == pytest.approx(3 / 4)
    assert s.output_throughput == pytest.approx(6 / 4)
    # prompt and cached tokens of every request (the failed one too), as the hit bounds count
    assert (s.prompt_tokens, s.output_tokens, s.cached_tokens) == (53, 6, 5)
    assert s.cache_hit_rate == pytest.approx(5 / 53)
    assert s.input_throughput == pytest.approx(45 / 4)
    ttfts = [1.0, 1.0, 1.0]
    assert s.ttft.p50 == pytest.approx(np.percentile(ttfts, 50))
    assert s.tpot.count == 2 and s.tpot.mean == pytest.approx((0.75 + 1.0) / 2)
    itls = [0.5, 1.0, 1.0]
    assert s.itl.count == 3
    for q, got in ((50, s.itl.p50), (90, s.itl.p90), (99, s.itl.p99)):
        assert got == pytest.approx(np.percentile(itls, q))
    assert s.e2e.max == pytest.approx(2.5)
    assert summarize(records, retracts=9).retracts == 9


def test_summary_of_nothing_is_nan_not_an_error() -> None:
    s = summarize([])
    assert s.num_requests == 0 and math.isnan(s.request_throughput) and math.isnan(s.ttft.p99)


def _best_hits_by_brute_force(prompts: list[list[int]], page_size: int) -> int:
    """Try every order with the cache manager's rules (page aligned, match <= len - 1)."""
    best = 0
    for order in itertools.permutations(prompts):
        inserted: set[tuple[int, ...]] = set()
        hits = 0
        for prompt in order:
            matchable_pages = (len(prompt) - 1) // page_size
            matched = 0
            while (
                matched < matchable_pages and tuple(prompt[: (matched + 1) * page_size]) in inserted
            ):
                matched += 1
            hits += matched * page_size
            for pages in range(1, len(prompt) // page_size + 1):
                inserted.add(tuple(prompt[: pages * page_size]))
        best = max(best, hits)
    return best


def test_optimal_hit_hand_made_cases() -> None:
    # A is a prefix of B: run A first, B reuses all 3 of A's tokens; its last token is computed.
    assert optimal_hit([[1, 2, 3, 4], [1, 2, 3]]).hit_tokens == 3
    # identical prompts: the second must still compute its last token.
    assert optimal_hit([[1, 2, 3], [1, 2, 3]]).hit_tokens == 2
    # disjoint prompts share nothing.
    assert optimal_hit([[1, 2], [3, 4]]).hit_tokens == 0
    # few-shot: 3 questions behind one 4-token prefix -> 2 of them reuse the prefix.
    few_shot = [[9, 9, 9, 9, q] for q in (1, 2, 3)]
    result = optimal_hit(few_shot)
    assert (result.prompt_tokens, result.hit_tokens, result.trie_pages) == (15, 8, 7)
    assert result.rate == pytest.approx(8 / 15)


def test_optimal_hit_is_page_aligned() -> None:
    # page 4: the shared 6-token prefix only shares its first whole page.
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8]]
    assert optimal_hit(prompts, page_size=4).hit_tokens == 4
    # an exact page multiple computes its own last page: [1..8] then [1..8, 9] reuses 8.
    assert optimal_hit([[*range(1, 9), 9], list(range(1, 9))], page_size=4).hit_tokens == 8
    assert optimal_hit([list(range(1, 9))] * 2, page_size=4).hit_tokens == 4
    assert optimal_hit([[1, 2, 3]], page_size=4).hit_tokens == 0
    with pytest.raises(ValueError):
        optimal_hit([[1]], page_size=0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=5),
    st.sampled_from([1, 2, 3]),
)
def test_optimal_hit_equals_best_order_brute_force(
    prompts: list[list[int]], page_size: int
) -> None:
    assert optimal_hit(prompts, page_size).hit_tokens == _best_hits_by_brute_force(
        prompts, page_size
    )


def test_inter_token_gaps_are_each_requests_own_diffs() -> None:
    rng = np.random.default_rng(0)
    times = [np.cumsum(rng.random(int(n))).tolist() for n in rng.integers(0, 6, size=200)]
    times += [[], [1.0], [2.0, 2.5], []]
    expected = [np.diff(np.asarray(t, float)) for t in times if len(t) > 1]
    assert np.array_equal(inter_token_gaps(times), np.concatenate(expected))
    assert inter_token_gaps([]).size == 0
    assert inter_token_gaps([[], [3.0]]).size == 0
