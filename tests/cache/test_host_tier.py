"""The host tier under the prefix cache: evicted pages are copied out to the swap space's host
pages and back into fresh pool pages on a hit (the copies ride in the next plan, out before in),
the tree takes them back, both allocators' invariants hold, and KV events name the tier."""

from __future__ import annotations

import numpy as np

from asyncengine.cache import KVCacheManager
from asyncengine.cache.kv_events import BlockRemoved, BlockStored
from asyncengine.cache.swap_space import SwapSpace


def manager(num_pages: int = 8, host_pages: int = 16) -> KVCacheManager:
    return KVCacheManager(
        num_pages,
        4,
        max_rows=4,
        max_pages_per_row=8,
        kv_events=True,
        swap=SwapSpace(host_pages, page_bytes=64),
        host_tier=True,
        max_tail_pages=0,
    )


def run(mgr: KVCacheManager, tokens: list[int]) -> int:
    """Open, admit, compute the rest, close into the cache; the tokens the cache gave."""
    seq = mgr.open(tokens)
    mgr.count_admitted(seq, len(tokens))
    cached = seq.num_cached
    mgr.extend(seq, len(tokens) - seq.kv_len)
    seq.computed_len = seq.kv_len
    mgr.close(seq, tokens)
    mgr.check_invariant()
    return cached


def test_an_evicted_prefix_comes_back_from_the_host_tier() -> None:
    mgr = manager()
    first = list(range(100, 121))  # 5 whole pages + 1 token
    assert run(mgr, first) == 0
    mgr.swap.drain()
    assert run(mgr, list(range(200, 221))) == 0  # needs the pool: the first prompt goes to host
    out, into = mgr.swap.drain()
    assert sum(len(c.pool_pages) for c in out) >= 3 and not into
    events = mgr.tree.drain_events()
    assert any(isinstance(e, BlockStored) and e.medium == "cpu" for e in events)
    assert mgr.tree.prefix_length(first) < 20
    got = run(mgr, first)  # the tree's pages and then the host's, copied back
    assert got == 20
    out, into = mgr.swap.drain()
    assert into and mgr.host_hit_tokens > 0
    assert mgr.stats()["host_tier_loaded_pages"] == sum(len(c.host_pages) for c in into)
    mgr.check_invariant()


def test_a_full_host_tier_drops_its_oldest_pages_and_frees_them_later() -> None:
    mgr = manager(num_pages=8, host_pages=6)
    for start in range(0, 2000, 100):  # many distinct prompts through a small pool and tier
        run(mgr, list(range(start, start + 21)))
        mgr.swap.drain()
    stats = mgr.stats()
    assert stats["host_tier_dropped_pages"] > 0 and stats["host_tier_pages"] <= 6
    assert any(isinstance(e, BlockRemoved) and e.medium == "cpu" for e in mgr.tree.drain_events())
    mgr.reset()
    mgr.swap.drain()
    mgr.swap.drain()  # released pages are free two plans later
    assert mgr.swap.num_free == 6
    np.testing.assert_array_equal(np.sort(mgr.swap.allocator.free_pages()), np.arange(6))


def test_a_prefix_whose_host_pages_the_room_for_it_drops_is_computed() -> None:
    """Opening a prompt found in the tier evicts a leaf for pool room; the leaf spills into a
    full tier, which drops the pages just found: they are not copied back (they are gone)."""
    mgr = manager(num_pages=8, host_pages=4)
    first = list(range(100, 121))  # 5 whole pages + 1 token
    run(mgr, first)
    mgr.swap.drain()
    run(mgr, list(range(200, 221)))  # evicts the first prompt: its first 4 pages to the tier
    mgr.swap.drain()
    assert mgr.stats()["host_tier_pages"] == 4 and mgr.tree.prefix_length(first) == 0
    seq = mgr.open(first)  # the 4 pages found; room for them evicts the second prompt
    assert seq.num_cached == 0 and mgr.stats()["host_tier_dropped_pages"] == 4
    _, into = mgr.swap.drain()
    assert not into and mgr.host_hit_tokens == 0
    mgr.check_invariant()
