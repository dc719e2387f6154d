"""StepPrefixes: the uncached prefixes one step's prefills will compute, for in-batch dedup.

The radix tree learns a prompt only when its prefill commits, so two prompts admitted in the
same step that share a prefix the tree does not hold yet would each compute it. The scheduler
records here the first uncached page of every prompt it extends in a step, and defers a
candidate whose own first uncached page is one of them: one step later that page (and
whatever more the two share) is in the tree and the candidate hits it.

Two prompts share an uncached page only if they share everything before it, and the tree
matches a shared path to the same length for both, so looking at the first uncached page is
enough: it is keyed by (matched length, page tokens) and a key collision is confirmed by
comparing the matched prefixes.

Below a page the same holds for a prompt that ends with this step (``keeps_tail``: its last,
partly filled page is kept for reuse, cache/tail_pages.py): a candidate that shares at least
``min_tail_gain`` more of its next uncached tokens with that prompt than with any tail kept
now waits a step and then copies their KV from the prompt's kept page. (Not for any shared
token: prompts of one template share their first words, and deferring on those would run them
one a step.)
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncengine.cache.tail_pages import common_length

PageKey = tuple[int, tuple[int, ...]]
TailKey = tuple[int, int]  # (whole-page start, the first token after it)


class StepPrefixes:
    def __init__(self, page_size: int, defer_on_tails: bool = True) -> None:
        """``defer_on_tails`` False: only whole pages defer a prompt (the step shares what is
        below a page in its forward instead: step_shares.py)."""
        self.page_size = page_size
        self.defer_on_tails = defer_on_tails
        self._pages: dict[PageKey, list[Sequence[int]]] = {}
        self._tails: dict[TailKey, list[Sequence[int]]] = {}
        self.min_tail_gain = max(2, page_size // 4)

    def clear(self) -> None:
        self._pages.clear()
        self._tails.clear()

    def __bool__(self) -> bool:
        """Whether this step added anything (else ``shares`` is False for every prompt)."""
        return bool(self._pages or self._tails)

    def add(self, ids: Sequence[int], computed: int, keeps_tail: bool = False) -> None:
        """``ids`` is being extended this step from ``computed`` tokens already in KV (and,
        with ``keeps_tail``, ends with it, its last partial page kept)."""
        ps = self.page_size
        start = computed // ps * ps  # what the tree holds of it: whole pages only
        if self.defer_on_tails and keeps_tail and len(ids) % ps >= 2 and len(ids) - start < ps:
            self._tails.setdefault((start, int(ids[start])), []).append(ids)
        if len(ids) < start + ps:
            return  # no whole page left for another prompt to share
        key = (start, tuple(ids[start : start + ps]))
        self._pages.setdefault(key, []).append(ids)

    def shares(self, ids: Sequence[int], matched: int, from_tails: int = 0) -> bool:
        """Whether ``ids`` (``matched`` tokens cached, ``from_tails`` more in a kept tail) would
        recompute a page, or enough of a tail, added this step.

        Only a page the prompt could take from the cache counts: at least one of its tokens
        is always computed, so a last page ending the prompt is never a hit (see
        ``KVCacheManager.match_length``)."""
        ps = self.page_size
        if self._tails and len(ids) - 1 >= matched + 2:
            most = min(ps - 1, len(ids) - 1 - matched)  # a take leaves one token to compute
            for other in self._tails.get((matched, int(ids[matched])), ()):
                gain = common_length(other[matched:], ids[matched : matched + most]) - from_tails
                if gain >= self.min_tail_gain and other[:matched] == ids[:matched]:
                    return True
        if not self._pages or len(ids) - 1 < matched + ps:
            return False
        others = self._pages.get((matched, tuple(ids[matched : matched + ps])))
        if not others:
            return False
        head = ids[:matched]
        return any(other[:matched] == head for other in others)
