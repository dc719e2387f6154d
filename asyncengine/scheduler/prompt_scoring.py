"""Prompt scoring (``SamplingParams.prompt_logprobs``) on the scheduler side: which positions of
a request's prompt still need their logits, the prefix-cache match that leaves them computed,
and the ``PromptScoring`` of each prefill segment. The executor computes what a segment's
``PromptScoring`` asks (executor/prompt_logprobs.py); ``Scheduler.commit`` appends the answer to
``Request.prompt_logprobs``.

The logits at position ``p`` score the prompt token at ``p + 1``. A request scoring its prompt
from token ``t0 = max(1, prompt_logprobs_start)`` needs the logits at positions ``t0 - 1`` to
``len(prompt) - 2``; those positions are computed even when the radix cache holds their KV (the
match is cut before them: ``cache_match_limit``), so the answer is the same with the cache on or
off, and the scheduler's prefill budget counts every token it computes. The one exception: the
positions whose scores the prompt score cache holds (cache/prompt_scores.py: a prefix scored
before, the context of another choice) may come from the caches, their scores with their KV
(``take_cached_scores``), so only the rest is computed; and so may the positions of a kept tail
page (cache/tail_pages.py: a context shorter than a page) with the scores kept beside it
(``take_tail``).
"""

from __future__ import annotations

from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.prompt_scores import PromptScoreCache
from asyncengine.common.plan import PromptScoring, TokenLogprobs
from asyncengine.common.request import Request


def first_scored_token(req: Request) -> int:
    """The first prompt position whose token gets a logprob (position 0 has none)."""
    return max(1, req.params.prompt_logprobs_start)


def tokens_to_score(req: Request) -> int:
    """How many prompt tokens the request scores in all (0 when it does not score)."""
    if req.params.prompt_logprobs is None:
        return 0
    return max(0, len(req.prompt_ids) - first_scored_token(req))


def next_scored_position(req: Request) -> int | None:
    """The first position whose logits are still to compute, None when none are (a request
    recomputed after a retraction scores nothing twice)."""
    if req.params.prompt_logprobs is None:  # it scores nothing (tokens_to_score: 0)
        return None
    done = len(req.prompt_logprobs) + req.borrowed_scores
    if done >= tokens_to_score(req):
        return None
    return first_scored_token(req) - 1 + done


def cache_match_limit(req: Request, scores: PromptScoreCache | None = None) -> int | None:
    """The most prompt tokens the request may take from the prefix cache (None: no limit): none
    for a mean-pooled embedding (pooling.py), none past its first position still to score but
    those whose scores ``scores`` holds."""
    if req.embedding is not None and not req.embedding.reuses_prefix:
        return 0
    following = next_scored_position(req)
    if following is None or scores is None:
        return following
    assert req.params.prompt_logprobs is not None
    return scores.known_until(req.cache_prompt_ids, following, req.params.prompt_logprobs)


def may_reuse_prefix(req: Request, scores: PromptScoreCache | None) -> bool:
    """Whether a prefix the cache will hold could spare the request computing it: not for a
    mean-pooled embedding, nor, without a score cache, for a request scoring from its start."""
    if req.embedding is not None and not req.embedding.reuses_prefix:
        return False
    return scores is not None or cache_match_limit(req) != 0


def take_cached_scores(
    req: Request, scores: PromptScoreCache | None, tail: tuple[TokenLogprobs, ...] = ()
) -> None:
    """After the request's KV was matched (``cache_match_limit(req, scores)``): the scores of
    the positions it took from the prefix cache, from the score cache, then ``tail``, those of
    the positions it took from a kept tail (``take_tail``)."""
    following = next_scored_position(req)
    matched = req.kv.num_in_tree
    if following is not None and scores is not None and matched > following:
        assert req.params.prompt_logprobs is not None
        req.prompt_logprobs.extend(
            scores.take(req.cache_prompt_ids, following, matched, req.params.prompt_logprobs)
        )
    req.prompt_logprobs.extend(tail)


def take_tail(
    req: Request, kv: KVCacheManager, scores: PromptScoreCache | None
) -> tuple[TokenLogprobs, ...]:
    """After ``kv.open``: the KV of the tokens after the request's whole-page match from a kept
    tail page (cache/tail_pages.py) as far as it may take them, and the scores of the positions
    taken that it must score (for ``take_cached_scores``, once its prefill is admitted).

    The KV of position ``p`` depends on tokens ``0 .. p``, its score on ``0 .. p + 1``: sharing
    ``c`` tokens with the tail, the request may take the KV of ``c`` of them, or of ``c - 1``
    with the tail's scores of those positions (same top_k; only with a score cache, the
    switch for reusing scores). At least one prompt token is always computed."""
    if req.retractions or (req.embedding is not None and not req.embedding.reuses_prefix):
        return ()
    seq = req.kv
    found = kv.find_tail(seq, req.cache_ids)
    if found is None:
        return ()
    entry, common = found
    start = seq.kv_len
    most = req.num_tokens - 1 - start
    following = next_scored_position(req)
    taken_scores: tuple[TokenLogprobs, ...] = ()
    if following is None:
        take = min(common, most)
    else:
        # from ``start`` every position is to score (those before it came with whole pages)
        unscored = max(0, following - start)
        take = min(common, most, unscored)
        if scores is not None and entry.top_k == req.params.prompt_logprobs:
            scored = min(common - 1, most, len(entry.scores))
            if scored > take:
                take, taken_scores = scored, entry.scores[unscored:scored]
    if take <= 0 or not kv.take_tail(seq, entry, take):
        return ()
    return taken_scores


def tail_scores(req: Request, start: int) -> tuple[tuple[TokenLogprobs, ...], int] | None:
    """The request's prompt scores of positions ``start ..`` and their top_k, to keep with its
    tail page (None: it scored none of them, or not from ``start``)."""
    if req.params.prompt_logprobs is None or not req.prompt_logprobs:
        return None
    first = first_scored_token(req) - 1
    if first > start:
        return None
    return tuple(req.prompt_logprobs[start - first :]), req.params.prompt_logprobs


def keep_scores(req: Request, scores: PromptScoreCache | None, before: int) -> None:
    """Offer the score cache the pages the request's last ``len(req.prompt_logprobs) - before``
    scores completed."""
    if scores is None or req.params.prompt_logprobs is None:
        return
    first = first_scored_token(req) - 1
    scores.store(
        req.cache_prompt_ids, first, req.prompt_logprobs, before, req.params.prompt_logprobs
    )


def segment_scoring(
    req: Request, start_pos: int, end_pos: int, lead: str | None = None
) -> PromptScoring | None:
    """What a segment computing positions ``start_pos .. end_pos - 1`` of ``req`` scores;
    with ``lead`` (the rid of the segment of the same plan that computes position
    ``start_pos - 1``, whose KV ``req`` copied), that position's logits too."""
    following = next_scored_position(req)
    if following is None:
        return None
    if lead is not None:
        assert following == start_pos - 1, "a lead scores the position before the segment"
    else:
        assert start_pos <= following, "positions before the segment were computed unscored"
    first = following
    last = min(end_pos, len(req.prompt_ids) - 1)  # the last prompt position scores no prompt token
    if first >= last:
        return None
    assert req.params.prompt_logprobs is not None
    return PromptScoring(
        first, req.prompt_ids[first + 1 : last + 1], req.params.prompt_logprobs, lead
    )


def prompt_logprobs_by_position(req: Request) -> list[TokenLogprobs | None] | None:
    """One entry per prompt token (None where not scored: position 0, those before
    ``prompt_logprobs_start``), or None while the prompt is not wholly scored."""
    if req.params.prompt_logprobs is None or next_scored_position(req) is not None:
        return None
    unscored = len(req.prompt_ids) - len(req.prompt_logprobs)
    return [None] * unscored + list(req.prompt_logprobs)
