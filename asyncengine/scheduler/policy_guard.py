"""A policy's hooks run as a guest's code: one that raises, or answers what cannot be, costs the
engine nothing but the policy.

Its answers are checked before anything acts on them (an order names only requests of its
window, each once; a budget is whole numbers >= 0; preemption victims are running requests,
each once). A failed hook's step goes on as FCFS would have it (arrival order, the config's
budget, no victims); the failure is logged with its traceback and counted, and FCFS replaces the
policy from the next step, as a live swap would (the scheduler's ``policy_failed``). A shadow
policy that fails is dropped.

A policy that admits nothing while requests wait and nothing runs holds the engine idle (its
order, window or budget let nothing in: admission.py's ``POLICY_REASONS``). That may be what
it means (a batching window, pacing: ``Policy.wake_time`` may say until when), so
such steps are only counted (``PolicyStall``: ``policy_idle_holds`` and ``policy_idle_seconds``
in the stats) until the stall has lasted ``max_policy_stall`` seconds. Then it is a failure
like any other: a live engine logs it once, counts it and hands over to FCFS, so requests do
not wait forever on a policy that will never admit them (a budget of zeros); the simulator
raises ``PolicyStalledError`` instead, since a run that silently switched policy would
measure the wrong one. When admission is blocked otherwise (the KV pool full of pinned
prefixes, no LoRA slot) the policy is not to blame and no other would do better: such steps
are an ``IdleBlock``, which a live engine logs once, naming the reason, past
``max_policy_stall``, and the simulator names when it is stuck.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncengine.common.request import Request, RequestStatus
from asyncengine.policies.base import Policy, PolicyContext, StepBudget

# (hook name, what it raised): the scheduler's ``policy_failed``
PolicyFailed = Callable[[str, BaseException], None]

log = logging.getLogger("asyncengine.policies")  # not the scheduler's: reports quiet it

# A per-step hook call (order, budget) this slow is reported, once per policy: the engine runs
# the hooks on its event loop between steps, so every stream waits as long, while the simulator
# charges a policy no time at all
SLOW_HOOK_SECONDS = 0.05

# how often the live engine asks again while requests wait and nothing runs, unless the policy
# holds them and names a ``wake_time``; the simulator steps its clock by as much
IDLE_POLL_SECONDS = 0.002
_NAMED_REQUESTS = 5  # waiting requests a stall's message names


class PolicyAnswerError(ValueError):
    """A hook answered what the scheduler cannot act on."""


class PolicyStalledError(RuntimeError):
    """The policy admitted nothing for ``max_policy_stall`` seconds while requests waited and
    nothing ran."""


@dataclass(slots=True)
class PolicyStall:
    """Steps that ran nothing because the policy held every waiting request while nothing ran
    (``holds``), the seconds such stalls lasted (``seconds``, the one going on included by
    ``seconds_until``), and when the one going on began (``since``; None: none is)."""

    holds: int = 0
    seconds: float = 0.0
    since: float | None = None

    def held(self, now: float) -> float:
        """Count one such step; how long the stall has lasted so far."""
        self.holds += 1
        if self.since is None:
            self.since = now
        return now - self.since

    def ended(self, now: float) -> None:
        """A step ran (or nothing waits any more): the stall, if any, is over."""
        if self.since is not None:
            self.seconds += now - self.since
            self.since = None

    def seconds_until(self, now: float) -> float:
        return self.seconds + (0.0 if self.since is None else now - self.since)


@dataclass(slots=True)
class SlowHooks:
    """The policy whose slow hook call was reported (None: none yet)."""

    reported: Policy | None = None

    def took(self, policy: Policy, hook: str, seconds: float) -> None:
        if seconds < SLOW_HOOK_SECONDS or self.reported is policy:
            return
        self.reported = policy
        log.warning(
            "policy %r: a call of %s() took %.0f ms; the engine runs it between steps on its "
            "event loop, so every stream waited as long (a simulated run charges the policy no "
            "time and does not show it). Keep its work per step small: order only the "
            "requests it is given, keep answers from step to step",
            policy.name,
            hook,
            seconds * 1e3,
        )


@dataclass(slots=True)
class IdleBlock:
    """Steps that ran nothing while requests waited and nothing ran, with admission blocked
    by something other than the policy (``reason``, admission.py's): since when the spell going
    on began (None: none is) and whether it was reported."""

    reason: str | None = None
    since: float | None = None
    reported: bool = False

    def blocked(self, reason: str, now: float) -> float:
        """Count one such step; how long the spell has lasted so far."""
        self.reason = reason
        if self.since is None:
            self.since, self.reported = now, False
        return now - self.since

    def ended(self) -> None:
        """A step ran, the policy holds, or nothing waits: the spell, if any, is over."""
        self.reason = self.since = None


def blocked_message(
    reason: str, policy: Policy, seconds: float, waiting: int, pinned: int, pages: int
) -> str:
    """Why nothing has run for ``seconds`` while ``waiting`` requests wait, when the policy is
    not why (an ``IdleBlock``'s ``reason``), with the KV pool's ``pinned`` pages of ``pages``."""
    return (
        f"nothing has run for {seconds:.3f} s while {waiting} request(s) wait: admission is "
        f"blocked by {reason}, not by policy {policy.name!r} ({pinned} of {pages} KV pages "
        "are pinned)"
    )


def stalled_error(policy: Policy, seconds: float, waiting: Sequence[Request]) -> PolicyStalledError:
    """The error of a policy that has held every waiting request for ``seconds``."""
    named = ", ".join(repr(req.rid) for req in waiting[:_NAMED_REQUESTS])
    more = f" and {len(waiting) - _NAMED_REQUESTS} more" if len(waiting) > _NAMED_REQUESTS else ""
    return PolicyStalledError(
        f"policy {policy.name!r} admitted nothing for {seconds:.3f} s while nothing ran: "
        f"{len(waiting)} request(s) wait ({named}{more}). A policy that holds on purpose says "
        "until when in wake_time(); max_policy_stall bounds the wait (0: no bound)"
    )


def checked_wake_time(policy: Policy, answer: object) -> float | None:
    """``answer`` (``policy.wake_time``'s) when it is None or a finite number."""
    if answer is None:
        return None
    if (
        isinstance(answer, bool)
        or not isinstance(answer, (int, float))
        or not math.isfinite(answer)
    ):
        raise PolicyAnswerError(
            f"policy {policy.name!r}: wake_time() returned {answer!r}, not a time or None"
        )
    return float(answer)


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


# The compiled scheduler calls the hooks through these (this module runs interpreted): a call
# from compiled code checks the answer's type against the hook's signature first, and would
# raise its own TypeError before the answer reached the checks here.


def ordered_by(
    policy: Policy, window: list[Request], ctx: PolicyContext, slow: SlowHooks
) -> list[Request]:
    """``policy.order``'s answer for ``window``, checked (a slow call reported)."""
    start = time.perf_counter()
    answer = policy.order(window, ctx)
    slow.took(policy, "order", time.perf_counter() - start)
    return checked_order(policy, "order", window, answer)


def budget_of(policy: Policy, ctx: PolicyContext, slow: SlowHooks) -> StepBudget:
    """``policy.budget``'s answer, checked (a slow call reported)."""
    start = time.perf_counter()
    answer = policy.budget(ctx)
    slow.took(policy, "budget", time.perf_counter() - start)
    return checked_budget(policy, answer)


def candidates_of(policy: Policy, waiting: Sequence[Request], size: int) -> list[Request]:
    """``policy.candidates``' answer (waiting requests, each once), checked."""
    return checked_order(policy, "candidates", None, policy.candidates(waiting, size))


def wake_time_of(policy: Policy, ctx: PolicyContext) -> float | None:
    """``policy.wake_time``'s answer, checked."""
    return checked_wake_time(policy, policy.wake_time(ctx))


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
