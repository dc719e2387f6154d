"""TailPages keyed by prefixes whose hash is taken once: equal prefixes made apart find each
other, a tail of the same tokens replaces the older one, and the least recently used goes first."""

from __future__ import annotations

from asyncengine.cache.tail_pages import Prefix, TailPage, TailPages


def test_prefix_keys_equal_tokens_alike() -> None:
    a, b = Prefix(tuple(range(100))), Prefix(tuple(range(100)))
    assert a is not b and a == b and hash(a) == hash(b) == hash(tuple(range(100)))
    assert a != Prefix(tuple(range(99))) and a != tuple(range(100))
    assert len({(a, 1), (b, 1), (a, 2)}) == 2


def test_tails_found_replaced_and_dropped_by_equal_prefixes() -> None:
    tails = TailPages(max_pages=2)
    prefix = tuple(range(32))
    assert tails.add(TailPage(7, prefix, (1, 2, 3))) == []
    assert tails.add(TailPage(8, tuple(range(32)), (1, 2, 3))) == [7]  # the same tail: replaced
    found = tails.best(tuple(range(32)), [1, 2, 9])  # a prefix made apart
    assert found is not None and found[0].page == 8 and found[1] == 2
    assert tails.best(tuple(range(31)), [1, 2, 3]) is None
    assert tails.add(TailPage(9, (), (5,))) == []
    tails.touch(found[0])  # page 8 is now the most recently used
    assert tails.add(TailPage(10, (), (6,))) == [9]  # past max_pages: the LRU goes
    assert tails.pop_lru() == 8 and tails.pages() == [10]
    assert tails.best(prefix, [1, 2, 3]) is None
