"""KVCacheManager: open/extend/cache/close, sharing, eviction under pressure, the invariant."""

from __future__ import annotations

import numpy as np
import pytest

from asyncengine.cache import KVCacheManager, OutOfPagesError, OutOfRowsError, SeqKV


def make(num_pages: int = 16, page_size: int = 4, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(
        num_pages=num_pages,
        page_size=page_size,
        max_rows=kwargs.pop("max_rows", 4),  # type: ignore[arg-type]
        max_pages_per_row=kwargs.pop("max_pages_per_row", 8),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def run_prefill(mgr: KVCacheManager, tokens: list[int]) -> SeqKV:
    """Open ``tokens``, admitted: counted and given slots for every token."""
    seq = mgr.open(tokens)
    mgr.count_admitted(seq, len(tokens))
    mgr.extend(seq, len(tokens) - seq.kv_len)
    mgr.check_invariant()
    return seq


def test_fresh_sequence_gets_pages_and_a_table_row() -> None:
    mgr = make()
    tokens = list(range(10))
    seq = mgr.open(tokens)
    assert (seq.kv_len, seq.num_cached, seq.pages, seq.num_in_tree) == (0, 0, [], 0)
    mgr.extend(seq, 10)
    assert seq.kv_len == 10 and len(seq.pages) == 3
    assert mgr.page_table.array[seq.row, :3].tolist() == seq.pages
    mgr.extend(seq, 2)  # fills the partial last page: no new page
    assert len(seq.pages) == 3
    mgr.extend(seq, 1)
    assert len(seq.pages) == 4 and seq.kv_len == 13
    assert mgr.stats()["pages_used"] == 4
    mgr.check_invariant()


def test_second_request_reuses_the_cached_prefix() -> None:
    mgr = make()
    first = list(range(100, 110))
    seq = run_prefill(mgr, first)
    own_pages = list(seq.pages)
    mgr.close(seq, first)
    mgr.check_invariant()
    stats = mgr.stats()
    assert stats["pages_cached"] == 2 and stats["pages_evictable"] == 2
    assert stats["pages_free"] == 13 and stats["pages_tail"] == 1  # the partial page kept
    assert mgr.match_length(first[:8] + [1, 2, 3]) == 8
    again = mgr.open(first[:8] + [1, 2, 3])
    assert again.kv_len == again.num_cached == 8
    assert again.pages == own_pages[:2]
    assert mgr.stats()["pages_evictable"] == 0  # locked by the open sequence
    assert (mgr.stats()["hit_tokens"], mgr.stats()["miss_tokens"]) == (0, 10)  # not admitted yet
    mgr.count_admitted(again, 11)
    assert mgr.stats()["hit_tokens"] == 8
    assert mgr.stats()["miss_tokens"] == 10 + 3
    mgr.check_invariant()


def test_match_leaves_at_least_one_token_to_compute() -> None:
    mgr = make()
    tokens = list(range(8))
    mgr.close(run_prefill(mgr, tokens), tokens)
    assert mgr.match_length(tokens) == 4  # 7 tokens allowed, rounded down to a page
    seq = mgr.open(tokens)
    assert seq.kv_len == 4
    mgr.close(seq, cache=False)
    one_page = make(page_size=1)
    mgr1 = one_page
    mgr1.close(run_prefill(mgr1, [5, 6, 7]), [5, 6, 7])
    assert mgr1.open([5, 6, 7]).kv_len == 2
    assert mgr1.match_length([5]) == 0


def test_empty_and_sub_page_sequences() -> None:
    mgr = make()
    empty = mgr.open([])
    assert empty.kv_len == 0
    mgr.extend(empty, 0)
    mgr.close(empty, [])
    short = run_prefill(mgr, [1, 2, 3])  # shorter than a page: nothing in the tree
    mgr.close(short, [1, 2, 3])
    stats = mgr.stats()
    assert stats["pages_cached"] == 0 and stats["pages_free"] == 15 and stats["pages_tail"] == 1
    mgr.check_invariant()


def test_cache_dedupes_pages_another_request_inserted_first() -> None:
    mgr = make()
    tokens = list(range(12))
    a = run_prefill(mgr, tokens)
    b = run_prefill(mgr, tokens)  # nothing cached yet: computes its own copy
    assert set(a.pages).isdisjoint(b.pages)
    mgr.cache(a, tokens)
    mgr.check_invariant()
    b_pages = list(b.pages)
    free_before = mgr.stats()["pages_free"]
    mgr.cache(b, tokens)  # b's three pages duplicate a's: freed, b points at a's
    assert b.pages == a.pages and b.num_in_tree == 12
    assert mgr.page_table.array[b.row, :3].tolist() == a.pages
    assert mgr.stats()["pages_free"] == free_before + 3
    assert not set(b_pages) & set(a.pages)
    mgr.check_invariant()
    mgr.close(a, tokens)
    mgr.close(b, tokens)
    assert mgr.stats()["pages_cached"] == 3 and mgr.stats()["pages_used"] == 0
    mgr.check_invariant()


def test_cache_mid_generation_moves_the_lock() -> None:
    mgr = make()
    tokens = list(range(6))
    seq = run_prefill(mgr, tokens)
    mgr.cache(seq, tokens)
    assert seq.num_in_tree == 4 and seq.lock_node.prefix_len == 4
    tokens += [50, 51, 52]
    mgr.extend(seq, 3)
    mgr.cache(seq, tokens)
    assert seq.num_in_tree == 8 and seq.lock_node.prefix_len == 8
    assert mgr.stats()["pages_evictable"] == 0
    mgr.check_invariant()
    mgr.close(seq, tokens)
    assert mgr.stats()["pages_evictable"] == 2
    mgr.check_invariant()


def test_extend_evicts_lru_leaves_and_reuses_their_pages() -> None:
    mgr = make(num_pages=6, page_size=2)
    old = [1, 1, 1, 1]
    new = [2, 2, 2, 2]
    for tokens in (old, new):
        mgr.close(run_prefill(mgr, tokens), tokens)
    assert mgr.stats()["pages_cached"] == 4 and mgr.available_pages == 6
    old_pages = mgr.tree.match_prefix(old)[0].tolist()
    mgr.tree.match_prefix(new)  # new is the most recently used
    seq = mgr.open([3] * 8)
    mgr.extend(seq, 8)  # needs 4 pages, 2 free: evicts `old`
    assert set(old_pages) <= set(seq.pages)
    assert mgr.match_length(old + [0]) == 0 and mgr.match_length(new + [0]) == 4
    mgr.check_invariant()


def test_extend_failure_changes_nothing() -> None:
    mgr = make(num_pages=6, page_size=2)
    cached = [1, 1, 1, 1]
    mgr.close(run_prefill(mgr, cached), cached)
    holder = run_prefill(mgr, [2, 2, 2])  # 2 pages
    seq = mgr.open([3])
    before = (mgr.stats(), mgr.tree.dump(), mgr.page_table.array.copy())
    assert mgr.pages_needed(seq, 9) > mgr.available_pages
    with pytest.raises(OutOfPagesError, match="asked for 5 KV pages but only 2 are free and 2"):
        mgr.extend(seq, 9)
    assert (seq.kv_len, seq.pages) == (0, [])
    assert mgr.stats() == before[0] and mgr.tree.dump() == before[1]
    assert bool((mgr.page_table.array == before[2]).all())
    assert mgr.pages_needed(seq, 8) <= mgr.available_pages
    mgr.extend(seq, 8)
    mgr.check_invariant()
    mgr.close(holder, cache=False)
    mgr.close(seq, cache=False)
    mgr.check_invariant()


def test_pages_needed_accounts_for_partial_pages() -> None:
    mgr = make(num_pages=4, page_size=4)
    seq = mgr.open([0])
    mgr.extend(seq, 3)  # one page, 1 slot left in it
    assert mgr.pages_needed(seq, 1) == 0
    assert mgr.pages_needed(seq, 2) == 1
    assert mgr.pages_needed(seq, 13) == 3 == mgr.available_pages  # fits exactly
    assert mgr.pages_needed(seq, 14) == 4 > mgr.available_pages
    assert mgr.pages_needed(None, 12) == 3 and mgr.pages_needed(None, 13) == 4


def test_eviction_with_everything_locked_raises() -> None:
    mgr = make(num_pages=4, page_size=2)
    tokens = [1, 2, 3, 4, 5]
    a = run_prefill(mgr, tokens)
    mgr.cache(a, tokens)
    b = mgr.open(tokens)
    assert b.kv_len == 4
    assert mgr.evict(10) == 0  # all cached pages are locked by a and b
    assert mgr.available_pages == 1
    mgr.extend(b, 1)
    with pytest.raises(OutOfPagesError):
        mgr.extend(b, 2)
    mgr.check_invariant()


def test_close_without_cache_frees_everything_not_in_the_tree() -> None:
    mgr = make()
    tokens = list(range(9))
    seq = run_prefill(mgr, tokens)
    mgr.close(seq, tokens, cache=False)
    assert mgr.stats()["pages_free"] == 16 and mgr.stats()["pages_cached"] == 0
    with pytest.raises(ValueError, match="not open"):
        mgr.close(seq, tokens)  # double close
    with pytest.raises(ValueError, match="not open"):
        mgr.extend(seq, 1)
    mgr.check_invariant()


def test_prefix_cache_disabled() -> None:
    mgr = make(enable_prefix_cache=False)
    tokens = list(range(12))
    mgr.close(run_prefill(mgr, tokens), tokens)
    assert mgr.stats()["pages_cached"] == 0 and mgr.stats()["pages_free"] == 16
    assert mgr.match_length(tokens) == 0
    assert mgr.open(tokens).kv_len == 0
    mgr.check_invariant()


def test_limits_on_rows_and_request_length() -> None:
    mgr = make(max_rows=2, max_pages_per_row=2)
    with pytest.raises(ValueError, match="exceeds 8 tokens per request"):
        mgr.open(list(range(9)))
    seq = mgr.open([1])
    with pytest.raises(ValueError, match="exceeds 8 tokens per request"):
        mgr.extend(seq, 9)
    mgr.open([2])
    assert mgr.num_free_rows == 0
    with pytest.raises(OutOfRowsError):
        mgr.open([3])
    mgr.check_invariant()


def test_reset_requires_no_open_sequences() -> None:
    mgr = make()
    tokens = list(range(8))
    seq = run_prefill(mgr, tokens)
    with pytest.raises(RuntimeError, match="still open"):
        mgr.reset()
    mgr.close(seq, tokens)
    mgr.reset()
    assert mgr.stats()["pages_free"] == 16 and mgr.stats()["hit_tokens"] == 0
    assert mgr.stats()["miss_tokens"] == 8  # counters are monotonic unless asked
    mgr.tails.hit_tokens, mgr.host_hit_tokens = 5, 3  # as a run with tails and a host tier
    mgr.ledger.evictions = 2
    mgr.reset(reset_counters=True)
    counted = ("hit_tokens", "miss_tokens", "tail_hit_tokens", "host_hit_tokens", "evictions")
    assert [mgr.stats()[name] for name in counted] == [0, 0, 0, 0, 0]
    assert mgr.tree.ledger is mgr.ledger  # the tree counts its evictions in the new ledger
    mgr.check_invariant()


def test_invariant_catches_leaks_and_double_ownership() -> None:
    mgr = make()
    tokens = list(range(8))
    seq = run_prefill(mgr, tokens)
    leaked = seq.pages.pop()
    seq.kv_len = 4
    with pytest.raises(AssertionError, match=f"pages \\[{leaked}\\] are neither free"):
        mgr.check_invariant()
    seq.pages.append(leaked)
    seq.kv_len = 8
    mgr.check_invariant()
    mgr.cache(seq, tokens)
    other = mgr.open([9, 9, 9, 9, 9])
    mgr.extend(other, 5)
    other.pages[0] = seq.pages[0]  # claims a tree page as its own
    mgr.page_table.set_pages(other.row, 0, np.asarray(other.pages))
    with pytest.raises(AssertionError, match="already belong to the radix tree"):
        mgr.check_invariant()


def test_invariant_catches_a_wrong_lock_count() -> None:
    mgr = make()
    tokens = list(range(8))
    seq = run_prefill(mgr, tokens)
    mgr.cache(seq, tokens)
    mgr.tree.lock(seq.lock_node)  # a lock no open sequence accounts for
    with pytest.raises(AssertionError, match="lock_ref 2, but 1 open sequences lock it"):
        mgr.check_invariant()


def test_closing_a_sequence_drops_the_tail_copy_into_its_page() -> None:
    """An admission that fails after ``take_tail`` closes the sequence: its page is free again
    and must not be overwritten by the copy recorded for it before the next forward."""
    mgr = make()
    first = list(range(10))  # two whole pages and a tail of two tokens
    mgr.close(run_prefill(mgr, first), first)
    tokens = [*first, 70, 71]
    seq = mgr.open(tokens)
    found = mgr.find_tail(seq, tokens)
    assert found is not None and found[1] == 2
    assert mgr.take_tail(seq, found[0], 2)
    page = seq.pages[-1]
    mgr.check_invariant()  # the copy goes into a page the sequence holds
    mgr.close(seq, cache=False)
    assert page in mgr.allocator.free_pages().tolist()
    assert mgr.drain_page_copies() == []
    assert (mgr.hit_tokens, mgr.miss_tokens, mgr.tails.hit_tokens) == (0, 10, 0)
    mgr.check_invariant()


def test_invariant_catches_a_tail_copy_into_a_free_page() -> None:
    mgr = make()
    first = list(range(10))
    mgr.close(run_prefill(mgr, first), first)
    (tail,) = mgr.tails.pages()
    free = int(mgr.allocator.free_pages()[0])
    mgr._page_copies.append((tail, free))
    with pytest.raises(AssertionError, match=f"into page {free}, which belongs to the free list"):
        mgr.check_invariant()


def test_a_tail_given_back_while_a_copy_reads_it_goes_to_the_copying_sequence() -> None:
    """The page a recorded tail copy reads, given back for room before the copy runs: the
    copying sequence takes it (it holds that KV) and its fresh page is freed instead, so no
    host copy into a reused page lands before the tail copy reads it."""
    mgr = make()
    first = list(range(10))
    mgr.close(run_prefill(mgr, first), first)
    (tail,) = mgr.tails.pages()
    tokens = [*first, 70, 71]
    seq = mgr.open(tokens)
    found = mgr.find_tail(seq, tokens)
    assert found is not None and mgr.take_tail(seq, found[0], 2)
    fresh = seq.pages[-1]
    assert mgr.evict(1) == 1  # the kept tail goes first
    assert seq.pages[-1] == tail and fresh in mgr.allocator.free_pages().tolist()
    assert mgr.page_table.row_pages(seq.row, 3).tolist() == seq.pages
    assert mgr.drain_page_copies() == []
    mgr.check_invariant()
