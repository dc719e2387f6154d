"""Why-not-admitted accounting: the reason each step's admission stopped, per step and request.

Every step that leaves requests waiting is counted once under the reason the scheduler stopped
admitting; every request still waiting after the step is counted under the reason that kept it
out (``Request.blocked``):

- ``token_budget``: the step's prefill budget (policy ``budget()``, chunk size) was spent;
- ``kv_reservation``: its pages plus the reservation for admitted requests' future tokens did
  not fit in free + evictable KV memory, or its first chunk did not fit in what is left once
  its open locks its cached prefix;
- ``running_cap``: ``max_running_requests`` were admitted;
- ``chunk_in_flight``: a prompt is mid-chunk (at most one is, and it goes first);
- ``prefix_dedup``: it shares an uncached page with a prompt admitted this step and takes that
  page from the cache next step (in-batch dedup);
- ``policy_window``: it is not among the ``policy_window`` oldest waiting requests the policy
  orders, and every request the policy did order was admitted or held;
- ``policy_hold``: the policy left it out of its order this step (priority or SLO hold);
- ``decode_turn``: with mixed batches off, this step was a decode step;
- ``lora_slots``: its LoRA adapter is not in the step and ``max_loras`` adapters are (or its
  adapter drains to free a slot for another: lora_slots.py); admission went on past it.

A step that admits nothing while nothing runs is the policy's hold only when its reason is the
policy's (``POLICY_REASONS``): the stall check blames the policy for no other (policy_guard.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from asyncengine.common.request import Request

TOKEN_BUDGET = "token_budget"
KV_RESERVATION = "kv_reservation"
RUNNING_CAP = "running_cap"
CHUNK_IN_FLIGHT = "chunk_in_flight"
PREFIX_DEDUP = "prefix_dedup"
POLICY_WINDOW = "policy_window"
POLICY_HOLD = "policy_hold"
DECODE_TURN = "decode_turn"
LORA_SLOTS = "lora_slots"

# the reasons that are the policy's doing when a step admits nothing and nothing else runs (its
# budget, its order, its window); the others block admission whatever the policy answers
POLICY_REASONS = frozenset((TOKEN_BUDGET, POLICY_HOLD, POLICY_WINDOW))

REASONS = (
    TOKEN_BUDGET,
    KV_RESERVATION,
    RUNNING_CAP,
    CHUNK_IN_FLIGHT,
    PREFIX_DEDUP,
    POLICY_WINDOW,
    POLICY_HOLD,
    DECODE_TURN,
    LORA_SLOTS,
)


@dataclass(slots=True)
class Admission:
    """How one step's admission went: why it stopped (None: it tried every request the policy
    ordered), the requests the policy was asked to order, those it admitted, those it
    skipped (deferred by in-batch dedup, held by the policy, passed over because they did not
    fit in KV memory while ``kv_blocked_skips`` allowed it, or whose LoRA adapter could not
    join the step), and the running requests it retracted for them (a preempting policy)."""

    stopped: str | None = None
    window: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    deferred: list[Request] = field(default_factory=list)
    held: list[Request] = field(default_factory=list)
    skipped: list[Request] = field(default_factory=list)  # did not fit in KV; passed over
    preempted: list[Request] = field(default_factory=list)
    lora_blocked: list[Request] = field(default_factory=list)  # no LoRA slot; passed over

    # Written out because mypyc compiles this class (every step makes one) and leaves a
    # dataclass-made __init__ interpreted; tests/test_compiled.py checks it against the fields.
    def __init__(
        self,
        stopped: str | None = None,
        window: list[Request] | None = None,
        admitted: list[Request] | None = None,
        deferred: list[Request] | None = None,
        held: list[Request] | None = None,
        skipped: list[Request] | None = None,
        preempted: list[Request] | None = None,
        lora_blocked: list[Request] | None = None,
    ) -> None:
        self.stopped = stopped
        self.window = [] if window is None else window
        self.admitted = [] if admitted is None else admitted
        self.deferred = [] if deferred is None else deferred
        self.held = [] if held is None else held
        self.skipped = [] if skipped is None else skipped
        self.preempted = [] if preempted is None else preempted
        self.lora_blocked = [] if lora_blocked is None else lora_blocked


@mypyc_attr(allow_interpreted_subclasses=True)  # tests' reference log subclasses it
class AdmissionLog:
    """Counts of admission blocks: per step (``steps``) and per request (``Request.blocked``).

    Counting every waiting request every step would cost a step time in the queue's length.
    Instead, the requests waiting inside the policy's window all count the step's reason and
    those outside it all count one reason too, so each group keeps a running total per reason
    and each request a snapshot of its group's total, settled into ``Request.blocked`` when it
    changes group, leaves the engine, or is looked at (``settle``). A step then touches only
    the requests that entered or left the window, and those the policy held or dedup deferred.

    The requests inside the window still waiting are always the head of the waiting queue
    (admission removes from the window, arrivals append at the end), unless a retracted request
    went to the front, before or after the window was taken, or the policy added requests from
    past the head (``Policy.candidates``): only then is the whole window looked at again.
    """

    def __init__(self) -> None:
        self.steps: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._outside_totals = [0] * len(REASONS)
        self._inside_totals = [0] * len(REASONS)
        # id -> (request, snapshot of its group's totals)
        self._outside: dict[int, tuple[Request, tuple[int, ...]]] = {}
        self._inside: dict[int, tuple[Request, tuple[int, ...]]] = {}
        self._pushed = False  # a request went to the queue's front since the last step
        self._reshaped = False  # this step's window is not only the queue's head

    # -- the life of a request --------------------------------------------------------------
    def arrived(self, req: Request, front: bool = False) -> None:
        """``req`` joined the waiting queue (new at its end, or retracted to its ``front``)."""
        self._outside[id(req)] = (req, tuple(self._outside_totals))
        self._pushed = self._pushed or front

    def reshaped(self) -> None:
        """This step's window holds requests from past the queue's head (a policy's extra
        candidates): look at all of it, this step and the next (which may drop them)."""
        self._pushed = self._reshaped = True

    def left(self, req: Request) -> None:
        """``req`` left the engine: settle its counts."""
        self._leave(req)

    def settle(self, req: Request) -> dict[str, int]:
        """``req``'s counts up to now."""
        key = id(req)
        for group, totals in (
            (self._outside, self._outside_totals),
            (self._inside, self._inside_totals),
        ):
            entry = group.get(key)
            if entry is not None:
                _add(req, totals, entry[1])
                group[key] = (req, tuple(totals))
        return req.blocked

    def _leave(self, req: Request) -> None:
        key = id(req)
        entry = self._outside.pop(key, None)
        if entry is not None:
            _add(req, self._outside_totals, entry[1])
        entry = self._inside.pop(key, None)
        if entry is not None:
            _add(req, self._inside_totals, entry[1])

    def _enter(self, req: Request) -> None:
        key = id(req)
        entry = self._outside.pop(key, None)
        if entry is not None:
            _add(req, self._outside_totals, entry[1])
        self._inside[key] = (req, tuple(self._inside_totals))

    # -- one step ---------------------------------------------------------------------------
    def record(self, waiting: Sequence[Request], admission: Admission) -> None:
        """Count one step whose admission went as ``admission``; ``waiting`` is the queue after it."""
        inside = self._inside
        window = admission.window
        if self._pushed:  # the window is not the head it was: look at all of it
            self._pushed, self._reshaped = self._reshaped, False
            in_window = {id(req) for req in window}
            snapshot = tuple(self._outside_totals)
            for key, (req, _) in list(inside.items()):
                if key not in in_window:  # pushed out by requests put in front of it
                    self._leave(req)
                    self._outside[key] = (req, snapshot)
            for req in window:
                if id(req) not in inside:
                    self._enter(req)
        else:  # the head of the queue is still inside: only the window's tail is new
            for req in window[len(inside) :]:
                self._enter(req)
        for req in admission.admitted:
            self._leave(req)
        if inside and waiting and id(waiting[0]) not in inside:
            # retracted after this step's window was taken (decode shortage, preemption):
            # they went in front of the window, which is no longer the queue's head
            self._pushed = True
        if not waiting:
            return
        outside = len(waiting) - len(inside)
        # the reason of the requests the policy never saw
        beyond = admission.stopped or POLICY_WINDOW
        stopped = stop_reason(admission, outside)
        if stopped is None:
            return
        self.steps[stopped] += 1
        if outside:
            self._outside_totals[_INDEX[beyond]] += 1
        if inside:
            self._inside_totals[_INDEX[stopped]] += 1
            for group, reason in (
                (admission.deferred, PREFIX_DEDUP),
                (admission.held, POLICY_HOLD),
                (admission.skipped, KV_RESERVATION),
                (admission.lora_blocked, LORA_SLOTS),
            ):
                for req in group:  # they count this step's special reason, not the group's
                    blocked = req.blocked
                    blocked[reason] = blocked.get(reason, 0) + 1
                    blocked[stopped] = blocked.get(stopped, 0) - 1


def stop_reason(admission: Admission, outside: int) -> str | None:
    """Why a step that went as ``admission`` left requests waiting, ``outside`` of them past
    the policy's window: where it stopped, else (every request the policy ordered was tried)
    what kept the first of them out. None: nothing kept one out."""
    if admission.stopped is not None:
        return admission.stopped
    if admission.skipped:
        return KV_RESERVATION
    if admission.lora_blocked:
        return LORA_SLOTS
    if admission.held:
        return POLICY_HOLD
    if outside:
        return POLICY_WINDOW
    if admission.deferred:
        return PREFIX_DEDUP
    return None


def _add(req: Request, totals: list[int], snapshot: tuple[int, ...]) -> None:
    """Add what ``totals`` grew since ``snapshot`` to ``req``'s counts (dropping zeros)."""
    blocked = req.blocked
    for index, (now, then) in enumerate(zip(totals, snapshot, strict=True)):
        if now != then:
            reason = REASONS[index]
            count = blocked.get(reason, 0) + now - then
            if count:
                blocked[reason] = count
            else:
                del blocked[reason]


_INDEX = {reason: index for index, reason in enumerate(REASONS)}
