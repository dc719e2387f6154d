"""TailPages: the last, partly filled KV page of ended sequences, kept so that a later prompt
sharing the tokens of that page (beyond the whole pages the radix tree matches) copies their KV
instead of computing it: the sibling choices of a multiple-choice question whose shared context
is shorter than a page.

The radix tree holds whole pages only. When a sequence closes, the tokens past its last whole
page (``1 .. page_size - 1`` of them, KV written) stay in their page here, keyed by the whole-page
prefix before them. A new sequence whose tree match ends at that prefix and whose next tokens
share ``c`` tokens with such a tail gets a fresh page of its own, into which the executor copies
the tail's page before the plan's forward (``BatchPlan.page_copies``: copy on write, the tail's
page is never written again); it then computes from its first token not taken. The scores of
the tail's prompt positions (``SamplingParams.prompt_logprobs``) stay with it, so a scoring
request takes them too (prompt_scoring.py ``take_tail``).

A bounded LRU: its pages are the manager's fourth kind of page (free, held, in the tree, or
here), and are given back before any tree page is evicted when the free list runs short. A tail
given back while a copy from it still waits for the plan goes to the copying sequence in place
of its fresh page, which is freed instead (manager.py ``_give_back``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from asyncengine.common.plan import TokenLogprobs


class Prefix:
    """A whole-page prefix as a key, its hash taken once: a tuple hashes every item each time
    it is looked up (~2 us for a 500-token sequence), and a tail's prefix is looked up in two
    maps when kept and again when dropped. Equal to another ``Prefix`` of the same tokens."""

    __slots__ = ("tokens", "_hash")

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        self._hash = hash(tokens)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Prefix) and self._hash == other._hash and self.tokens == other.tokens
        )


TailKey = tuple[Prefix, tuple[int, ...]]  # (whole-page prefix, the tail's tokens)


@dataclass(slots=True, eq=False)
class TailPage:
    page: int  # holds the KV of positions len(prefix) .. len(prefix) + len(tokens) - 1
    prefix: tuple[int, ...]  # the tokens before it (whole pages)
    tokens: tuple[int, ...]
    # scores of positions len(prefix) .. len(prefix) + len(scores) - 1, with top_k alternatives
    scores: tuple[TokenLogprobs, ...] = ()
    top_k: int | None = None

    # Written out because mypyc compiles this class (an ended sequence keeps one) and leaves a
    # dataclass-made __init__ interpreted; tests/test_compiled.py checks it against the fields.
    def __init__(
        self,
        page: int,
        prefix: tuple[int, ...],
        tokens: tuple[int, ...],
        scores: tuple[TokenLogprobs, ...] = (),
        top_k: int | None = None,
    ) -> None:
        self.page = page
        self.prefix = prefix
        self.tokens = tokens
        self.scores = scores
        self.top_k = top_k


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TailPages:
    def __init__(self, max_pages: int) -> None:
        self.max_pages = max_pages
        self._entries: OrderedDict[TailKey, TailPage] = OrderedDict()
        # (prefix, first token) -> the tails there, by their tokens
        self._by_start: dict[tuple[Prefix, int], dict[tuple[int, ...], TailPage]] = {}
        self.hit_tokens = 0  # tokens whose KV sequences took from here

    def __len__(self) -> int:
        return len(self._entries)

    def pages(self) -> list[int]:
        return [entry.page for entry in self._entries.values()]

    def add(self, entry: TailPage) -> list[int]:
        """Keep ``entry``; returns the pages it no longer keeps (an older tail of the same
        tokens, the least recently used past ``max_pages``), for the free list."""
        if self.max_pages <= 0:
            return [entry.page]
        freed: list[int] = []
        prefix = Prefix(entry.prefix)
        key = (prefix, entry.tokens)
        old = self._entries.pop(key, None)
        if old is not None:
            freed.append(old.page)
        self._entries[key] = entry
        self._by_start.setdefault((prefix, entry.tokens[0]), {})[entry.tokens] = entry
        while len(self._entries) > self.max_pages:
            freed.append(self.pop_lru())
        return freed

    def best(
        self, prefix: tuple[int, ...], following: Sequence[int]
    ) -> tuple[TailPage, int] | None:
        """The tail after ``prefix`` that shares the most leading tokens with ``following``,
        and how many it shares (at least one), or None."""
        found: tuple[TailPage, int] | None = None
        if not following:
            return None
        for entry in self._by_start.get((Prefix(prefix), int(following[0])), {}).values():
            common = common_length(entry.tokens, following)
            if common > 0 and (found is None or common > found[1]):
                found = (entry, common)
        return found

    def touch(self, entry: TailPage) -> None:
        self._entries.move_to_end((Prefix(entry.prefix), entry.tokens))

    def pop_lru(self) -> int:
        """Drop the least recently used tail; its page."""
        (prefix, tokens), entry = self._entries.popitem(last=False)
        start = (prefix, tokens[0])
        siblings = self._by_start[start]
        del siblings[tokens]
        if not siblings:
            del self._by_start[start]
        return entry.page

    def clear(self) -> list[int]:
        pages = self.pages()
        self._entries.clear()
        self._by_start.clear()
        return pages
