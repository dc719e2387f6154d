"""Speculative decoding in the scheduler: each running request's guesses for a step (n-gram
proposals, or how many tokens the executor's draft model guesses), its decode segment with
them, and what a verified row commits."""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.cache.manager import KVCacheManager
from asyncengine.common.joined_ids import JoinedIds
from asyncengine.common.plan import Segment, StepOutput
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext
from asyncengine.scheduler.step_events import TokenEvent
from asyncengine.speculative.ngram import NgramProposer
from asyncengine.speculative.settings import SpeculativeConfig


def propose_guesses(
    settings: SpeculativeConfig | None,
    running: list[Request],
    policy: Policy,
    context: Callable[[int], PolicyContext],
    room: int,
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Each running request's guessed next tokens (by rid), as many as the policy allows it
    (``Policy.speculate``) and its output budget and the context (``room`` tokens) leave room
    for (the token after the guesses is sampled too). With a draft model the executor guesses
    them: the second dict says how many, by rid. Empty when off."""
    if settings is None or not running:
        return {}, {}
    ctx = context(len(running))
    out: dict[str, list[int]] = {}
    drafts: dict[str, int] = {}
    for req in running:
        k = min(policy.speculate(req, ctx), req.remaining_new_tokens - 1)
        k = max(0, min(k, room - req.num_tokens))
        if settings.method == "draft":
            # a grammar's mask after each guess is made before the forward (core.execute),
            # so a structured-output request's guesses must be known here: it gets none
            if k and req.grammar is None:
                drafts[req.rid] = k
            continue
        if req.proposer is None:
            req.proposer = NgramProposer(settings.prompt_lookup_min, settings.prompt_lookup_max)
        # indexes even when k is 0; reads the new tokens in place, never the whole context
        guesses = req.proposer.propose(JoinedIds(req.prompt_ids, req.output_ids), k)
        if guesses:
            out[req.rid] = guesses
    return out, drafts


def decode_segment(req: Request, guesses: list[int] | None, draft: int) -> Segment:
    """``req``'s decode this step: its last token, then its guesses (or ``draft`` slots)."""
    last = req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]
    if guesses:
        n = len(guesses)
        return Segment(
            req.rid,
            req.kv.row,
            [last, *guesses],
            req.kv.kv_len - 1 - n,
            True,
            guesses=n,
            lora=req.lora,
        )
    if draft:
        return Segment(
            req.rid, req.kv.row, [last], req.kv.kv_len - 1 - draft, True, draft=draft, lora=req.lora
        )
    return Segment(req.rid, req.kv.row, [last], req.kv.kv_len - 1, sample=True, lora=req.lora)


def commit_guesses(
    kv: KVCacheManager,
    req: Request,
    seg: Segment,
    entry: int,
    token: int,
    output: StepOutput,
    now: float,
    events: list[TokenEvent],
) -> tuple[int, int]:
    """A verified row: its accepted guesses, then the sampled token, are its new tokens;
    the slots of its rejected guesses (and of a draft model's unused ones) go back to the
    KV pool now. Returns (guesses verified, guesses accepted)."""
    if seg.draft:
        guesses = output.drafted[entry] if output.drafted else []
    else:
        guesses = seg.input_ids[1:]
    accepted = output.accepted[entry] if output.accepted else 0
    if accepted > len(guesses):
        raise ValueError(f"request {seg.rid!r}: {accepted} of {len(guesses)} guesses accepted")
    kept_logprobs = output.accepted_logprobs[entry] if output.accepted_logprobs else []
    req.proposed_guesses += len(guesses)
    req.accepted_guesses += accepted
    kv.truncate(req.kv, seg.start_pos + 1 + accepted)
    guessed = guesses[:accepted]
    logprobs = [*(kept_logprobs or [None] * accepted), output.logprobs[entry]]
    for new_token, token_logprobs in zip([*guessed, token], logprobs, strict=True):
        req.output_ids.append(new_token)
        req.token_times.append(now)
        events.append(TokenEvent(req, new_token, token_logprobs, len(req.output_ids)))
    return len(guesses), accepted
