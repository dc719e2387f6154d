"""Admitter: one step's admission, waiting requests into prefill (as mini-sglang's PrefillAdder).

The scheduler builds one each step with the step's token budget. It carries on the prompts
mid-chunk first, then asks the policy to order its window of the waiting queue and tries those
requests one at a time under the budget, ``max_running_requests`` and the KV memory check: a
request's uncached pages plus the reservation for every admitted request's future tokens must
fit in free and evictable memory, and its first chunk in what is left once its open locks its
cached prefix (a preempting policy may retract running requests to make it fit). What it did
and why it stopped is the ``Admission`` it returns (admission.py counts it). The simulator's
bulk decoding asks the same object whether a step admits nothing (sim/closed_admission.py).
"""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from asyncengine.scheduler.admission import (
    CHUNK_IN_FLIGHT,
    KV_RESERVATION,
    RUNNING_CAP,
    TOKEN_BUDGET,
    Admission,
    AdmissionLog,
)
from asyncengine.scheduler.lora_slots import LoraSlots
from asyncengine.scheduler.policy_guard import (
    PolicyFailed,
    SlowHooks,
    candidates_of,
    ordered_by,
    victims_named,
)
from asyncengine.scheduler.prefill import Prefill
from asyncengine.scheduler.prompt_scoring import may_reuse_prefix
from asyncengine.scheduler.retraction import Retraction
from asyncengine.scheduler.shadow import ShadowPolicy


class Admitter:
    ordered: list[Request]  # the policy's order of its window, once it is taken
    outcome: Admission  # the same

    def __init__(
        self,
        plan: BatchPlan,
        budget: StepBudget,
        num_decodes: int,
        prefill: Prefill,
        retraction: Retraction,
        policy: Policy,
        config: EngineConfig,
        shadow: ShadowPolicy | None,
        log: AdmissionLog,
        context: Callable[[int], PolicyContext],
        reserved_tokens: Callable[[], int],
        new_token_ratio: float,
        max_model_len: int,
        lora_slots: LoraSlots,
        policy_failed: PolicyFailed,
        slow_hooks: SlowHooks,
    ) -> None:
        """The step's ``plan`` and ``budget``; the scheduler's parts, policy and config; its
        policy context, its admitted requests' future tokens, and the ratio of those that
        pages are reserved for (the scheduler's, at this step); the step's LoRA slots."""
        self.plan = plan
        self.num_decodes = num_decodes
        self.prefill = prefill
        self.kv = prefill.kv
        self.waiting = prefill.waiting
        self.prefilling = prefill.prefilling
        self.retraction = retraction
        self.running = retraction.running
        self.policy = policy
        self.config = config
        self.shadow = shadow
        self.log = log
        self.context = context
        self.reserved_tokens = reserved_tokens
        self.ratio = new_token_ratio
        self.max_model_len = max_model_len
        self.lora_slots = lora_slots
        self.policy_failed = policy_failed  # a hook that fails: FCFS's answer (policy_guard.py)
        self.slow_hooks = slow_hooks
        chunk = budget.chunk_size
        # With chunking on, the chunk bounds the whole step's prefill, not only one prompt's
        # piece of it (as SGLang's chunked_prefill_size): otherwise a step could carry one
        # prompt's last chunk, the next prompt's first and short prompts between them.
        remaining = min(budget.prefill_tokens, chunk) if chunk else budget.prefill_tokens
        if budget.total_tokens is not None:
            remaining = min(remaining, budget.total_tokens - num_decodes)
        self.chunk = chunk
        self.remaining = remaining  # prefill tokens the step may still take
        self.lane = 0  # of those, kept from a prompt mid-chunk for short waiting prompts
        self.slots = 0  # running requests it may still add (stops_before_ordering sets it)
        self.reserved = 0  # future tokens of every admitted request (the same)
        self.skips = config.kv_blocked_skips  # too big for KV now, and may be passed
        self.ctx: PolicyContext | None = None  # made when the policy orders or may preempt

    def admit(self) -> Admission:
        """Fill the plan's extends: the prompts mid-chunk, then waiting requests."""
        prefill = self.prefill
        prefill.new_step()
        lane = self.lane = self._short_lane()
        remaining, stopped = prefill.continue_prefills(self.plan, self.remaining - lane, self.chunk)
        self.remaining = remaining + lane
        if stopped is not None:
            return Admission(stopped)
        if not self.waiting:
            return Admission()
        # nothing can be admitted: skip the policy's ordering work (unless it may preempt)
        stopped = self.stops_before_ordering()
        if stopped is not None:
            return Admission(stopped)
        outcome = self.outcome = self._order()
        for req in self.ordered:
            stopped = self._try(req)
            if stopped is not None:
                outcome.stopped = stopped
                return outcome
        # every ordered request was tried: say what would have stopped the next one
        stopped = self._budget_spent()
        if stopped is None and self._in_lane():
            stopped = CHUNK_IN_FLIGHT  # the longer ones wait for the prompt mid-chunk
        outcome.stopped = RUNNING_CAP if stopped is None and self.slots <= 0 else stopped
        return outcome

    def stops_before_ordering(self) -> str | None:
        """Why no waiting request can be admitted, told from counts before the policy orders
        any (None: it may): the budget, a prompt mid-chunk, the running cap or the KV
        reservation, the last two only when the policy does not preempt."""
        stopped = self._budget_spent()
        if stopped is not None:
            return stopped
        preempts = self.policy.preempts
        self.slots = self.config.max_running_requests - len(self.running) - len(self.prefilling)
        if self.slots <= 0 and not preempts:
            return RUNNING_CAP
        self.reserved = self.reserved_tokens()
        if self._alone() or preempts:
            return None
        if self._reservation(self.reserved) + 1 > self.kv.available_pages:
            return KV_RESERVATION  # not even a one-page request would fit
        return None

    def fits(self, req: Request) -> bool:
        """Whether ``req`` fits in KV memory now (after ``stops_before_ordering``), as
        admission asks it of a request that does not run alone."""
        matched, room = self._room(req)
        estimate = len(req.cache_ids) - matched
        return self._short(estimate, room, req.future_tokens(self.max_model_len), False) <= 0

    def _budget_spent(self) -> str | None:
        if self.remaining <= 0:
            return TOKEN_BUDGET
        if self.prefill.chunked is not None and self.chunk and not self.lane:
            return CHUNK_IN_FLIGHT  # at most one request mid-chunk
        return None

    def _short_lane(self) -> int:
        """Prefill tokens a prompt mid-chunk leaves to the short prompts waiting (vLLM's
        partial prefills): their lengths, up to ``short_prompt_tokens`` and half the step's
        budget, so a short request waits one step, not a long prompt's whole prefill."""
        cap = min(self.config.short_prompt_tokens, self.remaining // 2)
        if cap <= 0 or self.prefill.chunked is None or not self.chunk or not self.waiting:
            return 0
        lane = 0
        for req in self.waiting.head(self.config.policy_window):
            size = req.num_tokens  # its uncached tokens at most
            if size <= cap:
                lane += size
                if lane >= cap:
                    return cap
        return lane

    def _in_lane(self) -> bool:
        """A prompt is mid-chunk and short prompts may still join beside it."""
        return self.lane > 0 and self.prefill.chunked is not None

    def _alone(self) -> bool:
        """Nothing else runs: a request is admitted whatever it needs."""
        return not self.running and not self.prefilling and not self.plan.extends

    def _reservation(self, tokens: int) -> int:
        """Pages kept for ``tokens`` future tokens at this step's new-token ratio."""
        return self.kv.reservation_pages(tokens * self.ratio)

    def _need(self, estimate: int, future: int) -> int:
        """Pages a request computing ``estimate`` tokens needs, its reservation included."""
        return self.kv.pages_needed(None, estimate) + self._reservation(self.reserved + future)

    def _room(self, req: Request) -> tuple[int, int]:
        """The prompt tokens ``req``'s open would take from the cache now and the pages it may
        then have (Prefill.match_room)."""
        return self.prefill.match_room(req)

    def _short(self, estimate: int, room: int, future: int, alone: bool) -> int:
        """Pages a request computing ``estimate`` tokens is short of (0 or less: it fits): its
        first chunk (what ``Prefill.start`` extends it by) in the ``room`` its open leaves and,
        unless it runs ``alone``, its pages and the reservation for every admitted request's
        future tokens (``future`` its own) in free and evictable memory."""
        kv = self.kv
        first = self.prefill.chunk_take(estimate, self.remaining, self.chunk)
        short = kv.pages_needed(None, first) - room
        if alone:
            return short
        return max(short, self._need(estimate, future) - kv.available_pages)

    def _order(self) -> Admission:
        """The policy's order of its window (``self.ordered``); the outcome so far: the window,
        the requests the policy held."""
        # The policy orders the oldest ``policy_window`` requests (and any it adds from past
        # them: Policy.candidates); the rest wait in arrival order, which bounds each step's
        # ordering cost when the queue is very long.
        policy, shadow = self.policy, self.shadow
        size = self.config.policy_window
        if type(policy).candidates is Policy.candidates:
            window = policy.candidates(self.waiting, size)
        else:  # a policy that reaches past the oldest ones (waiting requests, each once)
            try:
                window = candidates_of(policy, self.waiting, size)
            except Exception as exc:
                self.policy_failed("candidates", exc)
                window = self.waiting.oldest(size)
        if len(window) > size:  # the policy added requests from past the oldest ones
            self.log.reshaped()
        if type(policy).order is Policy.order and shadow is None and not policy.preempts:
            self.ordered = window  # arrival order; nothing else reads a context: none is made
        else:
            self.ctx = self.context(self.num_decodes)
            try:
                self.ordered = ordered_by(policy, window, self.ctx, self.slow_hooks)
            except Exception as exc:
                self.policy_failed("order", exc)
                self.ordered = window
        outcome = Admission(window=window)
        if self.lora_slots.claimant is not None:
            self.lora_slots.renew(self.ordered)
        if len(self.ordered) < len(window):  # the policy holds the ones it left out
            kept = {id(req) for req in self.ordered}
            outcome.held = [req for req in window if id(req) not in kept]
        if shadow is not None:
            assert self.ctx is not None
            try:
                shadow.compare(window, self.ordered, self.ctx)
            except Exception as exc:
                self.policy_failed("shadow", exc)
        return outcome

    def _try(self, req: Request) -> str | None:
        """Admit ``req`` if it fits, or pass it over; why admission stops here (None: go on)."""
        stopped = self._budget_spent()
        if stopped is not None:
            return stopped
        lora = req.params.lora
        if lora is not None and not self.lora_slots.may_join(lora) and not self._free_slot(req):
            # its adapter cannot join this step: it waits, and those behind it may go
            self.lora_slots.refused(lora)
            self.outcome.lora_blocked.append(req)
            return None
        ids = req.cache_ids
        kv = self.kv
        matched, room = self._room(req)
        if self._deferred(req, ids, matched):
            # another prompt of this step computes the same uncached page: left waiting,
            # this one takes it (and whatever more they share) from the cache next step
            self.outcome.deferred.append(req)
            return None
        estimate = len(ids) - matched
        if estimate > self.remaining and self._in_lane():
            return None  # beside a prompt mid-chunk only prompts that end in this step join
        future = req.future_tokens(self.max_model_len)
        alone = self._alone()
        short = self._short(estimate, room, future, alone)
        if not alone and (self.slots <= 0 or short > 0):
            passed, stopped = self._make_room(req, short)
            if passed or stopped is not None:
                return stopped
            # retracted for it: what they computed is cached, and no longer locked by them
            alone = self._alone()
            matched, room = self._room(req)
            estimate = len(ids) - matched
            short = self._short(estimate, room, future, alone)
        if short > 0:
            return KV_RESERVATION  # alone, or still short after retracting: it cannot start
        if not alone:
            if not self.chunk and estimate > self.remaining:
                return TOKEN_BUDGET  # no chunking: a prompt over the budget runs alone
            ps = kv.page_size
            if self.chunk and ps <= estimate and self.remaining < ps:
                return TOKEN_BUDGET  # less than a page left: start it next step
        take = self.prefill.start(self.plan, req, self.remaining, self.chunk)
        if take is None:
            return KV_RESERVATION
        self.outcome.admitted.append(req)
        if lora is not None:
            self.lora_slots.joined(lora)
        self.remaining -= take
        self.slots -= 1
        self.reserved += future
        return None

    def _free_slot(self, req: Request) -> bool:
        """A preempting policy may free a LoRA slot for ``req``: the adapter of the first
        running request it names leaves the step when it names every request of that adapter
        in the step (they are retracted, their computed prefixes cached). Whether ``req``'s
        adapter may join now."""
        ctx, slots = self.ctx, self.lora_slots
        if ctx is None or not self.policy.preempts or slots.claimant not in (None, req.lora):
            return False
        named = victims_named(self.policy, req, list(self.running), ctx, self.policy_failed)
        if not named:
            return False
        leaving = named[0].params.lora
        if leaving is None:
            return False
        victims = [victim for victim in named if victim.params.lora == leaving]
        if len(victims) != slots.rows.get(leaving, 0):
            return False  # some of it is mid-prompt or not named: it cannot leave now
        for victim in victims:
            self.retraction.retract(victim, self.config)
            self.retraction.total_preemptions += 1
        self.outcome.preempted += victims
        self.slots += len(victims)
        self.reserved = self.reserved_tokens()  # without the victims' future tokens
        slots.left(leaving)
        return slots.may_join(req.params.lora or "")

    def _deferred(self, req: Request, ids: list[int], matched: int) -> bool:
        """In-batch dedup: a prompt of this step computes ``req``'s next uncached page (and
        ``req`` cannot copy it in this step instead)."""
        dedup = self.prefill.step_prefixes
        kv, scores = self.kv, self.prefill.prompt_scores
        return bool(
            dedup  # not None, and a prompt of this step added (else it shares nothing)
            and may_reuse_prefix(req, scores)
            and dedup.shares(ids, matched, kv.tail_match_length(ids, matched))
            and not self.prefill.copies_next_page_in_step(ids, matched)
        )

    def _make_room(self, req: Request, short: int) -> tuple[bool, str | None]:
        """``req`` does not fit (it is ``short`` of KV pages, or the running cap is reached):
        retract the running requests a preempting policy names for it, or pass it over while
        ``kv_blocked_skips`` allows. Returns whether it was passed over, and why admission
        stops (None: retracted for, it is to be tried again)."""
        victims = None
        if self.ctx is not None:  # none: the policy does not preempt (preempt_for's None)
            victims = self.retraction.preempt_for(
                req,
                self.policy,
                self.config,
                self.ctx,
                short,
                1 - self.slots,
                self.ratio,
                self.max_model_len,
            )
        if victims is None:
            if self.slots > 0 and self.skips > 0:  # it waits; a smaller one behind it may fit
                self.skips -= 1
                self.outcome.skipped.append(req)
                return True, None
            return False, RUNNING_CAP if self.slots <= 0 else KV_RESERVATION
        self.outcome.preempted += victims
        self.slots += len(victims)
        self.reserved = self.reserved_tokens()  # without the victims' future tokens
        return False, None
