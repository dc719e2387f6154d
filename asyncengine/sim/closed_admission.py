"""closed_admission: a step's admission told without running it, when it admits nothing.

In an overloaded simulation most steps end their admission the same way: the KV reservation
for the running requests' future tokens leaves no room for the next waiting request. Running
``Scheduler._admit`` for such a step builds the policy's context and window and matches the
head's prompt against the radix tree only to stop at its first check. ``closed_admission``
answers with the same ``Admission`` (the reason it stops, the window it would have ordered)
for the steps where that outcome is certain from counts alone, and None whenever admission
might admit, skip, hold, preempt or change anything: the caller then runs ``_admit`` itself.

It mirrors ``Scheduler._admit`` for a step with nothing mid-prompt, a policy that does not
preempt, and a running batch (the bulk decoder's steps); tests/test_bulk_decode.py compares
every admission count, record and step with the step-by-step simulator, which never uses it.
"""

from __future__ import annotations

from asyncengine.admission import (
    CHUNK_IN_FLIGHT,
    DECODE_TURN,
    KV_RESERVATION,
    RUNNING_CAP,
    TOKEN_BUDGET,
    Admission,
)
from asyncengine.policies.base import Policy
from asyncengine.prompt_scoring import cache_match_limit
from asyncengine.scheduler import Scheduler


def closed_admission(sched: Scheduler, num_decodes: int) -> Admission | None:
    """The step's admission when it certainly admits nothing (None: run ``_admit``).

    Calls the policy's ``budget`` exactly as the step would (once, when anything waits) and
    clears the step's prefix dedup as ``_admit`` does; changes nothing else."""
    if sched.prefilling or not sched.running or sched.policy.preempts:
        return None
    waiting = sched.waiting
    if not waiting:
        return Admission(DECODE_TURN)  # the step never calls _admit
    policy = sched.policy
    config = sched.config
    if policy.budgets:
        budget = policy.budget(sched._context(num_decodes))
        prefill_tokens, total_tokens, chunk = (
            budget.prefill_tokens,
            budget.total_tokens,
            budget.chunk_size,
        )
    else:  # Policy.budget: the config's limits
        prefill_tokens, total_tokens = config.max_prefill_tokens, None
        chunk = config.chunked_prefill_size
    remaining = min(prefill_tokens, chunk) if chunk else prefill_tokens
    if total_tokens is not None:
        remaining = min(remaining, total_tokens - num_decodes)
    if sched.step_prefixes is not None:
        sched.step_prefixes.clear()
    if remaining <= 0:
        return Admission(TOKEN_BUDGET)
    if sched.chunked is not None and chunk:
        return Admission(CHUNK_IN_FLIGHT)
    slots = config.max_running_requests - len(sched.running)
    if slots <= 0:
        return Admission(RUNNING_CAP)
    kv = sched.kv
    reserved = sched._reserved_tokens()
    available = kv.available_pages
    if sched._reservation(reserved) + 1 > available:
        return Admission(KV_RESERVATION)
    # Past this point _admit orders a window; only a policy that keeps the queue's order
    # (and passes nothing to a shadow) tries the queue's head first, and with no request to
    # skip the head alone decides.
    if (
        type(policy).order is not Policy.order
        or type(policy).candidates is not Policy.candidates
        or sched.shadow is not None
        or config.kv_blocked_skips > 0
    ):
        return None
    head = waiting[0]
    ids = head.cache_ids
    matched = kv.match_length(ids, cache_match_limit(head, sched.prompt_scores))
    # in-batch dedup holds nothing: nothing is extended this step before the head
    future = head.future_tokens(sched.max_model_len)
    need = kv.pages_needed(None, len(ids) - matched) + sched._reservation(reserved + future)
    if need <= available:
        return None  # the head fits: it is admitted
    return Admission(KV_RESERVATION, window=waiting.head(config.policy_window))
