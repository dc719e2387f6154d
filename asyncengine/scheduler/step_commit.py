"""What a landed step gives each of its requests, segment by segment: the KV it computed
(finished prompt chunks enter the prefix cache), prompt scores, the pooled parts of
embeddings, and sampled tokens (with the guesses a row verified: speculation.py). Whether a
token ends its request is the lifecycle's to say."""

from __future__ import annotations

from typing import NamedTuple

from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.prompt_scores import PromptScoreCache
from asyncengine.common.plan import BatchPlan, StepOutput, TokenLogprobs
from asyncengine.common.request import Request, RequestStatus
from asyncengine.scheduler.prompt_scoring import keep_scores
from asyncengine.scheduler.speculation import commit_guesses
from asyncengine.scheduler.step_events import TokenEvent


class Committed(NamedTuple):
    """What a landed step gave: sampled tokens, and the prefill-only requests (embeddings,
    pooling.py) whose prompt is computed now, their result complete."""

    tokens: list[TokenEvent]
    prompts_done: list[Request]


def commit_segments(
    plan: BatchPlan,
    output: StepOutput,
    owners: dict[str, Request | None],
    kv: KVCacheManager,
    prompt_scores: PromptScoreCache | None,
    prefilling: list[Request],
    running: list[Request],
    now: float,
) -> tuple[list[TokenEvent], list[Request], int, int]:
    """Apply ``output`` to the requests ``owners`` says ``plan``'s segments were planned for
    (None: gone); a request whose prompt is now computed moves from ``prefilling`` to
    ``running``. Returns the token events, the prefill-only requests done, and how many
    guesses were verified and accepted."""
    events: list[TokenEvent] = []
    prompts_done: list[Request] = []
    verified = accepted = 0
    sampled = iter(enumerate(zip(output.token_ids, output.logprobs, strict=True)))
    if len(output.pooled) != len(plan.pooled_segments):
        raise ValueError(
            f"step {plan.step} pools {len(plan.pooled_segments)} segments but the executor "
            f"returned {len(output.pooled)} pooled parts"
        )
    pooled = iter(output.pooled)
    scored = iter(output.prompt_logprobs)
    step_scores: dict[str, list[TokenLogprobs]] = {}  # rid -> its segment's scores
    for seg in plan.segments:
        req = owners.get(seg.rid)
        alive = req is not None and not req.finished  # else aborted while the step ran
        if req is not None and alive:
            req.kv.computed_len = seg.end_pos
        borrowed = plan.shared_scores.get(seg.rid)
        if borrowed is not None and req is not None:
            req.borrowed_scores = 0  # in req.prompt_logprobs from here on
        if seg.scoring is not None or borrowed is not None:
            prompt_logprobs = [] if seg.scoring is None else next(scored)
            step_scores[seg.rid] = prompt_logprobs
            if req is not None and alive:
                before = len(req.prompt_logprobs)
                for piece in borrowed or ():  # other segments of this step scored them
                    source = step_scores[piece.source]
                    req.prompt_logprobs.extend(source[piece.offset : piece.offset + piece.count])
                req.prompt_logprobs.extend(prompt_logprobs)
                keep_scores(req, prompt_scores, before)
        if not seg.sample:
            part = next(pooled) if seg.pool is not None else None
            if req is not None and alive:  # the chunk is shareable now
                kv.cache(req.kv, first_ids(req, seg.end_pos))
                if req.embedding is not None and part is not None:
                    req.embedding.add(part, seg.num_tokens)
                if req.prefill_only and seg.end_pos == req.num_tokens:
                    if req.embedding is not None:
                        req.embedding.finish()
                    prompts_done.append(req)
            continue
        entry, (token, logprobs) = next(sampled)
        if req is None or not alive:
            continue
        if seg.guesses or seg.draft:
            row_verified, row_accepted = commit_guesses(
                kv, req, seg, entry, token, output, now, events
            )
            verified += row_verified
            accepted += row_accepted
            continue
        if req.status is RequestStatus.PREFILLING:
            prefilling.remove(req)
            running.append(req)
            req.status = RequestStatus.RUNNING
            # the whole prompt is in KV now: share it while this request still decodes
            kv.cache(req.kv, first_ids(req, seg.end_pos))
        req.output_ids.append(token)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        events.append(TokenEvent(req, token, logprobs, len(req.output_ids)))
    return events, prompts_done, verified, accepted


def first_ids(req: Request, n: int) -> list[int]:
    """``req.cache_ids[:n]`` (read-only: it may be the prompt itself) in one copy at most:
    a request's prompt and output are hundreds of tokens, copied at each prefix it caches."""
    prompt = req.cache_prompt_ids
    if n >= len(prompt):
        output = req.output_ids
        if not output or n == len(prompt):
            return prompt
        return prompt + output[: n - len(prompt)]
    return prompt[:n]
