"""closed_admission: a step's admission told without running it, when it admits nothing.

In an overloaded simulation most steps end their admission the same way: the KV reservation
for the running requests' future tokens leaves no room for the next waiting request. Running
the whole admission for such a step builds the policy's context and window and matches the
head's prompt against the radix tree only to stop at its first check. ``closed_admission``
answers with the same ``Admission`` (the reason it stops, the window it would have ordered)
for the steps where that outcome is certain, and None whenever admission might admit, skip,
hold, preempt or change anything: the caller then runs the scheduler's ``admit``.

It asks the scheduler's own ``Admitter`` (admitter.py) for the checks admission makes before
the policy orders anything and for whether the queue's head fits; what it adds is when those
decide the step: nothing mid-prompt, a policy that does not preempt and keeps the queue's
order, a running batch (the bulk decoder's steps). tests/sim/test_bulk_decode.py compares every
admission count, record and step with the step-by-step simulator, which never uses it.
"""

from __future__ import annotations

from asyncengine.common.plan import BatchPlan
from asyncengine.policies.base import Policy
from asyncengine.scheduler.admission import DECODE_TURN, KV_RESERVATION, Admission
from asyncengine.scheduler.scheduler import Scheduler


def closed_admission(sched: Scheduler, num_decodes: int, empty: BatchPlan) -> Admission | None:
    """The step's admission when it certainly admits nothing (None: run ``admit``); ``empty``
    is an empty plan, which it leaves empty.

    Calls the policy's ``budget`` exactly as the step would (once, when anything waits) and
    clears the step's in-batch sharing as ``admit`` does; changes nothing else."""
    if sched.prefilling or not sched.running or sched.policy.preempts:
        return None
    waiting = sched.waiting
    if not waiting:
        return Admission(DECODE_TURN)  # the step never admits
    admitter = sched.admitter(empty, num_decodes)
    sched.prefill.new_step()
    stopped = admitter.stops_before_ordering()
    if stopped is not None:
        return Admission(stopped)
    # Past this point admission orders a window; only a policy that keeps the queue's order
    # (and passes nothing to a shadow) tries the queue's head first, and with no request to
    # skip the head alone decides (in-batch dedup holds nothing: nothing is extended before it).
    policy = sched.policy
    config = sched.config
    if (
        type(policy).order is not Policy.order
        or type(policy).candidates is not Policy.candidates
        or sched.shadow is not None
        or config.kv_blocked_skips > 0
    ):
        return None
    if admitter.fits(waiting[0]):
        return None  # the head fits: it is admitted
    return Admission(KV_RESERVATION, window=waiting.head(config.policy_window))
