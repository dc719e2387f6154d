"""Why-not-admitted accounting: the reason each step's admission stopped, per step and request.

Every step that leaves requests waiting is counted once under the reason the scheduler stopped
admitting; every request still waiting after the step is counted under the reason that kept it
out (``Request.blocked``):

- ``token_budget``: the step's prefill budget (policy ``budget()``, chunk size) was spent;
- ``kv_reservation``: its pages plus the reservation for admitted requests' future tokens did
  not fit in free + evictable KV memory;
- ``running_cap``: ``max_running_requests`` were admitted;
- ``chunk_in_flight``: a prompt is mid-chunk (at most one is, and it goes first);
- ``prefix_dedup``: it shares an uncached page with a prompt admitted this step and takes that
  page from the cache next step (in-batch dedup);
- ``policy_window``: it is not among the ``policy_window`` oldest waiting requests the policy
  orders, and every request the policy did order was admitted or held;
- ``policy_hold``: the policy left it out of its order this step (priority or SLO hold);
- ``decode_turn``: with mixed batches off, this step was a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.request import Request

TOKEN_BUDGET = "token_budget"
KV_RESERVATION = "kv_reservation"
RUNNING_CAP = "running_cap"
CHUNK_IN_FLIGHT = "chunk_in_flight"
PREFIX_DEDUP = "prefix_dedup"
POLICY_WINDOW = "policy_window"
POLICY_HOLD = "policy_hold"
DECODE_TURN = "decode_turn"

REASONS = (
    TOKEN_BUDGET,
    KV_RESERVATION,
    RUNNING_CAP,
    CHUNK_IN_FLIGHT,
    PREFIX_DEDUP,
    POLICY_WINDOW,
    POLICY_HOLD,
    DECODE_TURN,
)


@dataclass(slots=True)
class Admission:
    """How one step's admission went: why it stopped (None: it tried every request the policy
    ordered), the requests the policy was asked to order, and those it skipped (deferred by
    in-batch dedup, held by the policy)."""

    stopped: str | None = None
    window: list[Request] = field(default_factory=list)
    deferred: list[Request] = field(default_factory=list)
    held: list[Request] = field(default_factory=list)


class AdmissionLog:
    """Counts of admission blocks: per step (``steps``) and per request (``Request.blocked``)."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = dict.fromkeys(REASONS, 0)

    def record(self, waiting: list[Request], admission: Admission) -> None:
        """Count one step whose admission went as ``admission``; ``waiting`` is the queue after it."""
        if not waiting:
            return
        in_window = {id(req) for req in admission.window}
        outside = sum(1 for req in waiting if id(req) not in in_window)
        stopped = admission.stopped
        beyond = stopped or POLICY_WINDOW  # the reason of requests the policy never saw
        if stopped is None:
            if admission.held:
                stopped = POLICY_HOLD
            elif outside:
                stopped = POLICY_WINDOW
            elif admission.deferred:
                stopped = PREFIX_DEDUP
            else:
                return
        self.steps[stopped] += 1
        special = {id(req): PREFIX_DEDUP for req in admission.deferred}
        special.update((id(req), POLICY_HOLD) for req in admission.held)
        for req in waiting:
            key = id(req)
            reason = special.get(key) or (stopped if key in in_window else beyond)
            blocked = req.blocked
            blocked[reason] = blocked.get(reason, 0) + 1
