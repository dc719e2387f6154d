"""Prefill: the scheduler's prompt side, computing prompts in chunks.

A prompt is computed in page-aligned chunks under the step's token budget; the request mid-chunk
(at most one) goes first each step, and a finished chunk is cached at commit. Each chunk is a
``Segment`` of the plan; the last one samples the request's first token. Within a step, prompts
that share uncached tokens copy them from the one computing them (step_shares.py) or wait a
step for them (in-batch dedup, step_prefixes.py).
"""

from __future__ import annotations

from asyncengine.cache.allocator import OutOfPagesError
from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.prompt_scores import PromptScoreCache
from asyncengine.cache.radix_cache import PrefixEnd
from asyncengine.cache.swap_space import SwappedKV
from asyncengine.common.joined_ids import JoinedIds
from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment, SharedScores
from asyncengine.common.request import Request, RequestStatus
from asyncengine.scheduler.admission import KV_RESERVATION, TOKEN_BUDGET
from asyncengine.scheduler.prompt_scoring import (
    cache_match_limit,
    next_scored_position,
    segment_scoring,
    take_cached_scores,
    take_tail,
)
from asyncengine.scheduler.step_prefixes import StepPrefixes
from asyncengine.scheduler.step_shares import Piece, StepSegment, StepShares
from asyncengine.scheduler.waiting_queue import WaitingQueue


class Prefill:
    """Starts prompts (waiting to prefilling) and carries them on chunk by chunk; the
    scheduler's queues, the swapped-out KV it restores and the step's sharing are the
    scheduler's, held here by reference."""

    def __init__(
        self,
        kv: KVCacheManager,
        waiting: WaitingQueue,
        prefilling: list[Request],
        swapped: dict[int, SwappedKV],
        step_prefixes: StepPrefixes | None,
        step_shares: StepShares | None,
        prompt_scores: PromptScoreCache | None,
    ) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.waiting = waiting
        self.prefilling = prefilling
        # id(request) -> the KV a retracted request had swapped out (retraction.py)
        self.swapped = swapped
        self.step_prefixes = step_prefixes
        self.step_shares = step_shares
        self.prompt_scores = prompt_scores
        self.chunked: Request | None = None  # the one request mid-chunk
        # starts whose first chunk did not fit once opened: the open and its copies undone
        self.failed_starts = 0
        # id(request) -> where its cached prefix ended when admission or the policy last asked,
        # while it waits: a request that cannot start yet is asked about every step, with its
        # whole context after a retraction, and the tree is walked again only where it changed
        self.prefix_ends: dict[int, PrefixEnd] = {}

    def new_step(self) -> None:
        """Forget the last step's prompts: nothing of this step is shared yet."""
        if self.step_prefixes is not None:
            self.step_prefixes.clear()
        if self.step_shares is not None:
            self.step_shares.clear()

    def forget(self, req: Request) -> None:
        """``req`` left the engine."""
        if self.chunked is req:
            self.chunked = None
        if self.prefix_ends:
            self.prefix_ends.pop(id(req), None)

    def match_room(self, req: Request) -> tuple[int, int]:
        """The prompt tokens ``req``'s open would take from the cache now and the pages it may
        then have (KVCacheManager.match_room), from its last answer while that holds."""
        key = id(req)
        limit = cache_match_limit(req, self.prompt_scores)
        matched, room, found = self.kv.match_room_again(
            req.cache_ids, limit, self.prefix_ends.get(key)
        )
        if found is not None:
            self.prefix_ends[key] = found
        return matched, room

    def cached_len(self, req: Request) -> int:
        """The prompt tokens ``req``'s open would take from the cache now (``match_room``'s
        first answer) without the room, from its last answer while that holds: what a policy
        orders waiting requests by (PolicyContext.cached_prefix)."""
        key = id(req)
        limit = cache_match_limit(req, self.prompt_scores)
        matched, found = self.kv.match_length_again(req.cache_ids, limit, self.prefix_ends.get(key))
        if found is not None and req.status is RequestStatus.WAITING:
            self.prefix_ends[key] = found  # kept while it waits: start and forget drop it
        return matched

    def chunk_take(self, todo: int, remaining: int, chunk: int) -> int:
        """Tokens of a prompt's ``todo`` this step computes: all without chunking, else what the
        budget and the chunk allow, cut to whole pages when the prompt does not end here."""
        take = min(todo, remaining, chunk) if chunk else todo
        if take < todo and take >= self.page_size:
            take = take // self.page_size * self.page_size
        return take

    def continue_prefills(
        self, plan: BatchPlan, remaining: int, chunk: int
    ) -> tuple[int, str | None]:
        """The requests mid-prompt go first: their next chunks into ``plan``. Returns the prefill
        tokens left and, when one could not go on, why admission stops."""
        for req in list(self.prefilling):
            if remaining <= 0:
                return remaining, TOKEN_BUDGET
            if req.kv.kv_len >= req.num_tokens:
                continue  # its last chunk is in a forward that has not landed (overlap)
            take = self.chunk_take(req.num_tokens - req.kv.kv_len, remaining, chunk)
            computed = req.kv.kv_len
            if not self._try_extend(req, take):
                return remaining, KV_RESERVATION
            self._note_segment(req, self._add_extend(plan, req, take))
            if self.step_prefixes is not None:
                self.step_prefixes.add(req.cache_ids, computed)
            remaining -= take
        return remaining, None

    def start(self, plan: BatchPlan, req: Request, remaining: int, chunk: int) -> int | None:
        """Move a waiting request to prefilling with its first chunk in ``plan``; the tokens it
        takes, or None (nothing changed) when the KV pool cannot hold that chunk."""
        ids = req.cache_ids
        req.seq = self.kv.open(ids, cache_match_limit(req, self.prompt_scores))
        tail = take_tail(req, self.kv, self.prompt_scores)
        cached = req.kv.kv_len
        # a request swapped out when preempted gets back the KV the tree no longer holds by
        # copy (no compute, no budget), then computes what it never had
        swapped = self.swapped.pop(id(req), None) if req.retractions and self.swapped else None
        restore = max(0, swapped.computed_len - cached) if swapped is not None else 0
        take = self.chunk_take(len(ids) - cached - restore, remaining, chunk)
        if not self._try_extend(req, restore + take):
            self.failed_starts += 1
            # closing drops the tail copy take_tail recorded; nothing was counted yet
            self.kv.close(req.kv, [], cache=False)
            req.seq = None
            if swapped is not None:
                self.swapped[id(req)] = swapped
            return None
        if swapped is not None:
            self.kv.swap_in(req.kv, swapped, cached)
        take_cached_scores(req, self.prompt_scores, tail)
        shared = None
        if self.step_shares is not None and swapped is None:
            shared = self._share_in_step(plan, req, take)
            if shared is not None:
                take -= shared.copied
        self.waiting.remove(req)
        if self.prefix_ends:
            self.prefix_ends.pop(id(req), None)
        req.status = RequestStatus.PREFILLING
        if req.retractions == 0:  # a retracted request's prompt was counted when first admitted
            req.cached_tokens = req.kv.num_cached
            self.kv.count_admitted(req.kv, len(ids))
        self.prefilling.append(req)
        lead = None if shared is None else shared.lead
        self._note_segment(req, self._add_extend(plan, req, take, lead), shared)
        if self.step_prefixes is not None:
            # a prompt that ends with this step keeps its last partial page for the others
            ends = cached + restore + take == len(ids) and (
                req.prefill_only or req.params.max_new_tokens <= 1
            )
            self.step_prefixes.add(ids, req.kv.num_cached, keeps_tail=ends)
        return take

    def copies_next_page_in_step(self, ids: list[int], matched: int) -> bool:
        """Whether a segment of this step computes the page of ``ids`` after its ``matched``
        cached tokens: it copies them in this step (step_shares.py) instead of waiting one."""
        if self.step_shares is None:
            return False
        most = min(self.page_size, len(ids) - 1 - matched)
        found = self.step_shares.best(ids, matched, most)
        return found is not None and found[1] >= most

    def _share_in_step(self, plan: BatchPlan, req: Request, take: int) -> StepSegment | None:
        """Of the ``take`` positions ``req`` was to compute from its first uncached one, those
        it copies instead from a segment of this plan (step_shares.py), the copies and borrowed
        scores recorded in ``plan``; at least one position is left to compute. Returns what
        to register for the prompts after it (None: it shares nothing)."""
        shares = self.step_shares
        assert shares is not None
        if req.retractions or (req.embedding is not None and not req.embedding.reuses_prefix):
            return None  # as with kept tails; a mean-pooled embedding sums every position
        ids = req.cache_ids
        at = req.kv.kv_len - take
        most = min(len(ids) - 1 - at, take - 1)
        found = shares.best(ids, at, most)
        if found is None:
            return None
        seg, common = found
        following = next_scored_position(req)
        scored: list[Piece] = []
        lead: str | None = None
        if following is None:
            shared = min(common, most)
        elif following == at:
            # the scores of all shared positions but the last from the segments scoring them;
            # the last one's logits from the segment computing it (the lead)
            shared = min(common, most)
            k = req.params.prompt_logprobs
            scored = shares.score_pieces(seg, at, at + shared - 1)
            if all(
                (sc := piece.segment.scoring) is not None
                and sc.top_k == k
                and sc.first <= piece.begin
                and piece.end <= sc.first + sc.num_positions
                for piece in scored
            ):
                lead = shares.pieces(seg, at + shared - 1, at + shared)[0].segment.rid
            else:
                shared, scored = 0, []
        else:
            shared = min(common, most, following - at)
        if shared <= 0:
            return None
        for piece in shares.pieces(seg, at, at + shared):
            pages = piece.segment.pages
            plan.kv_copies.extend(
                (shares.slot(pages, p), shares.slot(req.kv.pages, p))
                for p in range(piece.begin, piece.end)
            )
        if scored:
            plan.shared_scores[req.rid] = [
                SharedScores(
                    piece.segment.rid,
                    piece.begin - piece.segment.scoring.first,  # type: ignore[union-attr]
                    piece.end - piece.begin,
                )
                for piece in scored
            ]
            req.borrowed_scores = shared - 1
        self.kv.note_shared(req.kv, shared)
        return StepSegment(req.rid, ids, req.kv.pages, at, req.kv.kv_len, None, shared, seg, lead)

    def _note_segment(
        self, req: Request, segment: Segment, shared: StepSegment | None = None
    ) -> None:
        """Offer this step's segment to the prompts admitted after it (step_shares.py)."""
        if self.step_shares is None:
            return
        if shared is not None:
            self.step_shares.add(
                StepSegment(
                    shared.rid,
                    shared.ids,
                    shared.pages,
                    shared.start,
                    segment.end_pos,
                    segment.scoring,
                    shared.copied,
                    shared.source,
                    shared.lead,
                )
            )
            return
        self.step_shares.add(
            StepSegment(
                req.rid,
                req.cache_ids,
                req.kv.pages,
                segment.start_pos,
                segment.end_pos,
                segment.scoring,
            )
        )

    def _try_extend(self, req: Request, take: int) -> bool:
        try:
            self.kv.extend(req.kv, take)
            return True
        except OutOfPagesError:
            return False

    def _add_extend(
        self, plan: BatchPlan, req: Request, take: int, lead: str | None = None
    ) -> Segment:
        start = req.kv.kv_len - take
        done = req.kv.kv_len == req.num_tokens
        ids = JoinedIds(req.prompt_ids, req.output_ids)[start : start + take]
        # a prefill-only request (an embedding, or max_new_tokens 0 scoring its prompt) samples
        # nothing: the lifecycle ends it once its prompt is computed
        sample = done and not req.prefill_only
        pool = None if req.embedding is None else req.embedding.segment_pool(final=done)
        scoring = segment_scoring(req, start, start + take, lead)
        segment = Segment(req.rid, req.kv.row, ids, start, sample, pool, scoring, lora=req.lora)
        plan.extends.append(segment)
        if sample:
            plan.sampling.append(SamplingInfo(req.params, req.prompt_ids, req.output_ids))
        if not done:
            self.chunked = req
        elif self.chunked is req:
            self.chunked = None
        return segment
