"""A policy's hooks run as a guest's code: one that raises, or answers what cannot be, costs the
engine nothing but the policy.

Its answers are checked before anything acts on them (an order names only requests of its
window, each once; a budget is whole numbers >= 0; preemption victims are running requests,
each once). A failed hook's step goes on as FCFS would have it (arrival order, the config's
budget, no victims); the failure is logged with its traceback and counted, and FCFS replaces the
policy from the next step, as a live swap would (the scheduler's ``policy_failed``). A shadow
policy that fails is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncengine.common.request import Request, RequestStatus
from asyncengine.policies.base import Policy, PolicyContext, StepBudget

# (hook name, what it raised): the scheduler's ``policy_failed``
PolicyFailed = Callable[[str, BaseException], None]


class PolicyAnswerError(ValueError):
    """A hook answered what the scheduler cannot act on."""


def checked_order(
    policy: Policy, hook: str, window: Sequence[Request] | None, ordered: object
) -> list[Request]:
    """``ordered`` (the answer of ``policy.order`` or ``policy.candidates``, ``hook``) when it
    is a list of waiting requests, each once, of ``window`` where it is given (None: the whole
    queue, whose length is not walked: any waiting request)."""
    if not isinstance(ordered, list):
        raise PolicyAnswerError(
            f"policy {policy.name!r}: {hook}() returned {type(ordered).__name__}, not a list"
        )
    allowed = None if window is None else {id(req) for req in window}
    seen: set[int] = set()
    for req in ordered:
        waiting = getattr(req, "status", None) is RequestStatus.WAITING
        if not waiting or (allowed is not None and id(req) not in allowed) or id(req) in seen:
            rid = getattr(req, "rid", repr(req))
            raise PolicyAnswerError(
                f"policy {policy.name!r}: {hook}() returned {rid!r}, which is not a waiting "
                "request it was given (or is there twice)"
            )
        seen.add(id(req))
    return ordered


def checked_budget(policy: Policy, budget: object) -> StepBudget:
    """``budget`` (``policy.budget``'s answer) when its fields are whole numbers >= 0."""
    if not isinstance(budget, StepBudget):
        raise PolicyAnswerError(
            f"policy {policy.name!r}: budget() returned {type(budget).__name__}, not a StepBudget"
        )
    for name in ("prefill_tokens", "total_tokens", "chunk_size"):
        value = getattr(budget, name)
        if name == "total_tokens" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PolicyAnswerError(
                f"policy {policy.name!r}: budget().{name} is {value!r}, not a whole number >= 0"
            )
    return budget


def checked_victims(policy: Policy, named: object) -> list[Request]:
    """``named`` (``policy.preempt_candidates``' answer) when it lists running requests, each
    once."""
    if not isinstance(named, list):
        raise PolicyAnswerError(
            f"policy {policy.name!r}: preempt_candidates() returned {type(named).__name__}"
        )
    seen: set[int] = set()
    for victim in named:
        if getattr(victim, "status", None) is not RequestStatus.RUNNING or id(victim) in seen:
            raise PolicyAnswerError(
                f"policy {policy.name!r} named {getattr(victim, 'rid', victim)!r} to preempt, "
                "which is not a running request (or named it twice)"
            )
        seen.add(id(victim))
    return named


def victims_named(
    policy: Policy,
    req: Request | None,
    running: list[Request],
    ctx: PolicyContext,
    failed: PolicyFailed,
) -> list[Request]:
    """The running requests ``policy`` names to preempt for ``req`` (None: KV ran short),
    checked; none where the hook fails (``failed`` hears of it)."""
    try:
        return checked_victims(policy, policy.preempt_candidates(req, running, ctx))
    except Exception as exc:
        failed("preempt_candidates", exc)
        return []
