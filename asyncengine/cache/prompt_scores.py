"""PromptScoreCache: the prompt scores (SamplingParams.prompt_logprobs) of cached prefixes, by
page, so a request sharing a prefix with one scored before (the choices of a multiple-choice
question after their shared context) takes that prefix's scores and its KV from the caches and
computes only the rest.

The logits at position ``p`` score the prompt token at ``p + 1``: the score of position ``p``
(that token's logprob and the ``top_k`` most likely tokens) depends on tokens ``0 .. p + 1`` and
nothing else. A *scored page* is the ``page_size`` scores of the positions of one KV page,
``j * page_size .. (j + 1) * page_size - 1``: it depends on the tokens up to the first one of the
next page, so it is keyed by the page's chained hash (``kv_events.page_hashes``, the hash the KV
events give the same page), that next token and ``top_k`` (a different k would give other
alternatives). A request whose prefix cache match ends at a page boundary then needs no logits
before it: the positions from there on are computed as usual.

A bounded LRU of pages, apart from the radix tree: a scored page whose KV the tree has evicted
is no use (the KV match is the shorter of the two) but no harm, and it ages out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from asyncengine.cache.kv_events import page_hashes
from asyncengine.common.plan import TokenLogprobs

PageKey = tuple[int, int, int]  # (chained page hash, the next page's first token, top_k)


class PromptScoreCache:
    def __init__(self, page_size: int, max_pages: int) -> None:
        if max_pages <= 0:
            raise ValueError(f"max_pages must be positive, got {max_pages}")
        self.page_size = page_size
        self.max_pages = max_pages
        self._pages: OrderedDict[PageKey, tuple[TokenLogprobs, ...]] = OrderedDict()
        self.hit_positions = 0  # scored positions taken from the cache instead of computed
        self.stored_pages = 0
        self.evicted_pages = 0

    def __len__(self) -> int:
        return len(self._pages)

    def known_until(self, prompt: Sequence[int], start: int, top_k: int) -> int:
        """The end of the run of positions from ``start`` whose scores are all cached: a page
        boundary past ``start``, or ``start`` itself when the page holding it is not cached.
        Only positions that score a prompt token count (``p <= len(prompt) - 2``)."""
        ps = self.page_size
        page = start // ps
        parent: int | None = None
        if page > 0:
            parent = page_hashes(prompt[: page * ps], ps)[-1]
        end = start
        while (page + 1) * ps <= len(prompt) - 1:
            (parent,) = page_hashes(prompt[page * ps : (page + 1) * ps], ps, parent)
            if (parent, int(prompt[(page + 1) * ps]), top_k) not in self._pages:
                break
            page += 1
            end = page * ps
        return end

    def take(self, prompt: Sequence[int], start: int, end: int, top_k: int) -> list[TokenLogprobs]:
        """The scores of positions ``start .. end - 1`` (``known_until`` said they are cached),
        marked recently used and counted as hits."""
        ps = self.page_size
        if end <= start:
            return []
        hashes = page_hashes(prompt[:end], ps)
        out: list[TokenLogprobs] = []
        for page in range(start // ps, end // ps):
            key = (hashes[page], int(prompt[(page + 1) * ps]), top_k)
            scores = self._pages[key]
            self._pages.move_to_end(key)
            out.extend(scores[max(0, start - page * ps) :])
        self.hit_positions += len(out)
        return out

    def store(
        self,
        prompt: Sequence[int],
        first: int,
        scores: Sequence[TokenLogprobs],
        before: int,
        top_k: int,
    ) -> None:
        """Keep the whole pages among the scores of positions ``first .. first + len(scores) - 1``
        (a request's scores so far) that the last ``len(scores) - before`` of them completed."""
        ps = self.page_size
        end = first + len(scores)
        first_page = -(-first // ps)  # a page scored only in part is not kept
        new_pages = range(max(first_page, (first + before) // ps), end // ps)
        if not new_pages:
            return
        hashes = page_hashes(prompt[: new_pages[-1] * ps + ps], ps)
        for page in new_pages:
            key = (hashes[page], int(prompt[(page + 1) * ps]), top_k)
            if key in self._pages:
                self._pages.move_to_end(key)
                continue
            self._pages[key] = tuple(scores[page * ps - first : (page + 1) * ps - first])
            self.stored_pages += 1
            if len(self._pages) > self.max_pages:
                self._pages.popitem(last=False)
                self.evicted_pages += 1

    def clear(self) -> None:
        self._pages.clear()

    def stats(self) -> dict[str, int]:
        return {
            "prompt_score_hit_positions": self.hit_positions,
            "prompt_score_pages": len(self._pages),
            "prompt_score_pages_stored": self.stored_pages,
            "prompt_score_pages_evicted": self.evicted_pages,
        }
