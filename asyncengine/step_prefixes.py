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
"""

from __future__ import annotations

from collections.abc import Sequence

PageKey = tuple[int, tuple[int, ...]]


class StepPrefixes:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._pages: dict[PageKey, list[Sequence[int]]] = {}

    def clear(self) -> None:
        self._pages.clear()

    def add(self, ids: Sequence[int], computed: int) -> None:
        """``ids`` is being extended this step from ``computed`` tokens already in KV."""
        ps = self.page_size
        start = computed // ps * ps  # what the tree holds of it: whole pages only
        if len(ids) < start + ps:
            return  # no whole page left for another prompt to share
        key = (start, tuple(ids[start : start + ps]))
        self._pages.setdefault(key, []).append(ids)

    def shares(self, ids: Sequence[int], matched: int) -> bool:
        """Whether ``ids`` (``matched`` tokens cached) would recompute a page added this step.

        Only a page the prompt could take from the cache counts: at least one of its tokens
        is always computed, so a last page ending the prompt is never a hit (see
        ``KVCacheManager.match_length``)."""
        ps = self.page_size
        if not self._pages or len(ids) - 1 < matched + ps:
            return False
        others = self._pages.get((matched, tuple(ids[matched : matched + ps])))
        if not others:
            return False
        head = ids[:matched]
        return any(other[:matched] == head for other in others)
