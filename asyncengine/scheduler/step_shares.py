"""StepShares: prompts of one step that go on with the same tokens past what the caches gave
them, so that one computes those tokens and the others copy their KV (and prompt scores)
inside the same forward instead of computing them again.

The radix tree learns a prompt only when its prefill commits, and a kept tail page only when
its sequence ends, so the choices of a multiple-choice question sent together (lm-eval's
``local-completions`` sends 16 prompts a request) would each compute their shared context.
Here the scheduler records every extend segment of the step as it plans it; a prompt admitted
after it whose tokens from its first uncached position ``at`` on are the segment's (with
everything before ``at`` the same) computes only what follows them: its KV slots of the shared
positions are copied from the segment's in every layer, after the layer stores the forward's
K/V and before it attends (``BatchPlan.kv_copies``), and a scoring prompt takes the segment's
scores of those positions at commit (``BatchPlan.shared_scores``).

A segment's copied positions are shared too: each copy reads the slot of the segment that
computes the position (``pieces``), never a slot that is itself a copy target in the same
layer. The taker always computes at least one token.
The KV of position ``p`` depends on tokens ``0 .. p``, its score on ``0 .. p + 1``: sharing
``c`` tokens, a prompt takes the KV of the ``c`` positions, the scores of the first ``c - 1``
(same ``top_k``) and, for the last, the final hidden state of the segment computing it, scored
against its own next token (``PromptScoring.lead``): the choices of a question compute their
context once, the position where they part included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from asyncengine.cache.tail_pages import common_length
from asyncengine.common.plan import PromptScoring


@dataclass(frozen=True, slots=True)
class StepSegment:
    rid: str
    ids: Sequence[int]  # the request's tokens (prompt, then output)
    pages: Sequence[int]  # its KV pages: position p is in slot pages[p // size] * size + p % size
    start: int  # its first position not cached before the step: copied from here, or computed
    end: int  # one past the last position it computes
    scoring: PromptScoring | None  # the scores it computes
    copied: int = 0  # positions start .. start + copied - 1 are copied from ``source``
    source: StepSegment | None = None
    # the rid of the segment computing position start + copied - 1, whose logits there score
    # this one's next token (a scoring prompt's last copied position)
    lead: str | None = None


@dataclass(frozen=True, slots=True)
class Piece:
    """Positions ``begin .. end - 1`` of ``segment``, which computes them in this step."""

    segment: StepSegment
    begin: int
    end: int


# up to this many segments in a step, ``best`` looks at each instead of indexing their pages
# (most steps of an overloaded server admit one or two prompts of hundreds of tokens)
_SCAN_AT_MOST = 8


class StepShares:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._segments: list[StepSegment] = []  # this step's, in the order they were added
        # (page start, the token there) -> the segments holding some position of that page
        self._by_page: dict[tuple[int, int], list[StepSegment]] = {}
        self._indexed = 0  # the first ``_indexed`` segments are in ``_by_page``

    def clear(self) -> None:
        self._segments.clear()
        self._by_page.clear()
        self._indexed = 0

    def add(self, segment: StepSegment) -> None:
        self._segments.append(segment)

    def _index(self) -> None:
        ps, by_page = self.page_size, self._by_page
        for segment in self._segments[self._indexed :]:  # in the order they were added
            ids = segment.ids
            for page_start in range(segment.start // ps * ps, segment.end, ps):
                by_page.setdefault((page_start, int(ids[page_start])), []).append(segment)
        self._indexed = len(self._segments)

    def _holding(self, page_start: int, token: int, at: int) -> Sequence[StepSegment]:
        """The segments holding position ``at`` whose page there starts with ``token``, in the
        order they were added: ``_by_page``'s list for that page, filtered, or with a few
        segments the same ones found by looking at each."""
        segments = self._segments
        if len(segments) <= _SCAN_AT_MOST:
            return [
                seg
                for seg in segments
                if seg.start <= at < seg.end and int(seg.ids[page_start]) == token
            ]
        if self._indexed < len(segments):
            self._index()
        return [
            seg for seg in self._by_page.get((page_start, token), ()) if seg.start <= at < seg.end
        ]

    def best(self, ids: Sequence[int], at: int, most: int) -> tuple[StepSegment, int] | None:
        """The segment of this step that holds the most of ``ids[at : at + most]`` (computed
        or copied in this step) with the same tokens before ``at``, and how many leading tokens
        of those it has (at least 1)."""
        if most <= 0:
            return None
        page_start = at // self.page_size * self.page_size
        found: tuple[StepSegment, int] | None = None
        head = list(ids[:at])
        for seg in self._holding(page_start, int(ids[page_start]), at):
            common = common_length(seg.ids[at : min(seg.end, at + most)], ids[at : at + most])
            if common > 0 and (found is None or common > found[1]) and list(seg.ids[:at]) == head:
                found = (seg, common)
        return found

    def pieces(self, segment: StepSegment, begin: int, end: int) -> list[Piece]:
        """Positions ``begin .. end - 1`` of ``segment`` (``segment.start <= begin``), each
        range with the segment that computes it: a copied range resolves to its source."""
        out: list[Piece] = []
        copy_end = segment.start + segment.copied
        if begin < copy_end:
            assert segment.source is not None
            middle = min(end, copy_end)
            out += self.pieces(segment.source, begin, middle)
            begin = middle
        if begin < end:
            out.append(Piece(segment, begin, end))
        return out

    def score_pieces(self, segment: StepSegment, begin: int, end: int) -> list[Piece]:
        """As ``pieces``, for the scores of positions ``begin .. end - 1``: a copied position
        that the segment scores itself (its lead) is its own, not its source's (whose score
        there is of another next token)."""
        out: list[Piece] = []
        copy_end = segment.start + segment.copied
        if segment.scoring is not None:
            copy_end = min(copy_end, segment.scoring.first)
        if begin < copy_end:
            assert segment.source is not None
            middle = min(end, copy_end)
            out += self.score_pieces(segment.source, begin, middle)
            begin = middle
        if begin < end:
            out.append(Piece(segment, begin, end))
        return out

    def slot(self, pages: Sequence[int], position: int) -> int:
        return pages[position // self.page_size] * self.page_size + position % self.page_size
