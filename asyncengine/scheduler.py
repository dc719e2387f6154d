"""Scheduler: turns waiting and running requests into BatchPlans, and commits their results.

Shared by every policy: the policy only orders the waiting queue and sets the step's token
budgets. The scheduler admits under those budgets and a KV memory check, chunks long
prefills (at most one request mid-chunk, and it goes first), mixes decodes into prefill
steps, retracts running requests when decode runs out of KV pages (or when a preempting
policy names them for a blocked waiting request), counts why admission stopped each step
(admission.py), and keeps the radix cache in step with every request's life. Which requests
end, and why, is the lifecycle's decision (lifecycle.py); ``finish`` releases them here. It
never touches tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from asyncengine.admission import (
    CHUNK_IN_FLIGHT,
    DECODE_TURN,
    KV_RESERVATION,
    RUNNING_CAP,
    TOKEN_BUDGET,
    Admission,
    AdmissionLog,
)
from asyncengine.cache.allocator import OutOfPagesError
from asyncengine.cache.manager import KVCacheManager
from asyncengine.config import EngineConfig
from asyncengine.plan import BatchPlan, SamplingInfo, Segment, StepOutput
from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from asyncengine.request import Request, RequestStatus
from asyncengine.shadow import ShadowPolicy
from asyncengine.step_events import TokenEvent
from asyncengine.step_prefixes import StepPrefixes

log = logging.getLogger("asyncengine.scheduler")


class PendingPolicy(NamedTuple):
    """A policy handed over by ``set_policy``, with the config that names it."""

    policy: Policy
    config: EngineConfig


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        policy: Policy,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        shadow: ShadowPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.shadow = shadow
        self._next_policy: PendingPolicy | None = None  # takes over at the next schedule()
        self.policy_swaps = 0
        self.max_model_len = max_model_len
        self.clock = clock
        self.page_size = kv.page_size
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []  # admitted; prompt not fully computed
        self.running: list[Request] = []  # decoding
        self.requests: dict[str, Request] = {}
        self.chunked: Request | None = None  # the one request mid-chunk
        self.new_token_ratio = config.init_new_token_ratio
        self.step_count = 0
        self.consecutive_prefill_steps = 0
        self.total_retractions = 0
        self.total_preemptions = 0  # retractions a policy asked for (counted in retractions too)
        self.total_prefix_deferrals = 0
        self.admission = AdmissionLog()
        self.inflight: BatchPlan | None = None
        # rid -> request of the plan in flight. A request aborted while its step
        # runs leaves ``requests``, and a new one may take its id at once: commit and fail go
        # by these objects, so the old step's token never lands on the new request.
        self._inflight_owners: dict[str, Request | None] = {}
        # the uncached prefixes this step's prefills compute, when in-batch dedup is on
        self.step_prefixes: StepPrefixes | None = None
        if config.enable_inbatch_prefix_dedup and kv.enable_prefix_cache:
            self.step_prefixes = StepPrefixes(self.page_size)

    # -- queue ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in the engine")
        req.status = RequestStatus.WAITING
        self.requests[req.rid] = req
        self.waiting.append(req)
        self.admission.arrived(req)

    def blocked(self, req: Request) -> dict[str, int]:
        """Steps ``req`` has waited so far, by admission-block reason (admission.py)."""
        return self.admission.settle(req)

    def set_policy(self, policy: Policy, config: EngineConfig) -> str:
        """Hand ordering and budgets to ``policy`` (named by ``config``) from the next
        schedule() on: a step boundary, where running requests, their KV and the request
        mid-chunk are the scheduler's, not the policy's, and stay as they are. A swap still
        pending is replaced (it never ran). Returns the name of the policy running now."""
        self._next_policy = PendingPolicy(policy, config)
        self.policy_swaps += 1
        log.info("policy %r replaces %r at the next step", config.policy, self.config.policy)
        return self.config.policy

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def finish(
        self, req: Request, reason: str, matched: str | int | None = None, cache: bool = True
    ) -> None:
        """Release ``req``, whose end the lifecycle decided: it leaves every queue and its KV
        is closed (the computed prefix into the tree when ``cache``)."""
        if req.finished:
            return
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.PREFILLING:
            self.prefilling.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req.seq is not None:
            self.kv.close(req.seq, req.all_ids[: req.seq.computed_len], cache=cache)
            req.seq = None
        req.mark_finished(reason, matched, self.clock())
        del self.requests[req.rid]
        self.admission.left(req)
        self.policy.finished(req)
        if self.shadow is not None:
            self.shadow.finished(req)

    # -- planning -------------------------------------------------------------------------
    def _context(self, num_decodes: int) -> PolicyContext:
        return PolicyContext(
            config=self.config,
            now=self.clock(),
            num_running=len(self.running) + len(self.prefilling),
            num_decodes=num_decodes,
            prefix_len=self.kv.match_length,
            chunked=self.chunked,
        )

    def _reserved_tokens(self) -> int:
        """Future tokens of every admitted request, before ``new_token_ratio``."""
        cap = self.max_model_len
        return sum(r.future_tokens(cap) for r in self.running) + sum(
            r.future_tokens(cap) for r in self.prefilling
        )

    def _reservation(self, tokens: int) -> int:
        """Pages kept for ``tokens`` future tokens at this step's ``new_token_ratio``."""
        return self.kv.reservation_pages(tokens * self.new_token_ratio)

    def schedule(self) -> BatchPlan | None:
        """Build the next step's plan, or None when there is nothing to run."""
        if self._next_policy is not None:
            self.policy, self.config = self._next_policy
            self._next_policy = None
        self.step_count += 1
        plan = BatchPlan(step=self.step_count)
        mixed = self.config.enable_mixed_batch
        starved = self.consecutive_prefill_steps >= self.config.max_consecutive_prefill_steps
        prefill_wanted = bool(self.waiting or self.prefilling)
        decoding: list[Request] = []
        admission = Admission(DECODE_TURN)
        if mixed or not prefill_wanted or (starved and self.running):
            decoding = self._prepare_decodes()
        if prefill_wanted and (mixed or not decoding):
            budget = self.policy.budget(self._context(len(decoding)))
            admission = self._admit(plan, budget, len(decoding))
        if not decoding and not plan.extends and self.running and not mixed:
            decoding = self._prepare_decodes()  # nothing admitted: decode
            if not decoding and prefill_wanted:  # it retracted everything: memory is free now
                admission = self._admit(plan, self.policy.budget(self._context(0)), 0)
        if admission.preempted:  # a policy had some of this step's decodes retracted
            decoding = [req for req in decoding if req.status is RequestStatus.RUNNING]
        for req in decoding:
            plan.decodes.append(self._decode_segment(req))
            plan.sampling.append(SamplingInfo(req.params, req.prompt_ids, req.output_ids))
        if plan.extends and not plan.decodes:
            self.consecutive_prefill_steps += 1
        else:
            self.consecutive_prefill_steps = 0
        if plan.decodes and not plan.extends:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )
        if plan.is_empty():
            return None
        self.admission.record(self.waiting, admission)
        plan.page_writes = self.kv.page_table.drain_writes()
        now = self.clock()
        requests = self.requests
        owners: dict[str, Request | None] = {}
        for seg in plan.extends:
            req = requests[seg.rid]
            owners[seg.rid] = req
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        for seg in plan.decodes:
            owners[seg.rid] = requests[seg.rid]
        self.inflight = plan
        self._inflight_owners = owners
        return plan

    def _decode_segment(self, req: Request) -> Segment:
        last = req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]
        return Segment(req.rid, req.kv.row, [last], req.kv.kv_len - 1, sample=True)

    def _prepare_decodes(self) -> list[Request]:
        """Give every running request a KV slot for its next token, retracting when short."""
        ps = self.page_size
        retracted: list[Request] = []
        while self.running:
            need = sum(1 for r in self.running if r.kv.kv_len % ps == 0)
            if need <= self.kv.available_pages:
                break
            victim = self._pick_victim()
            self._retract(victim)
            self.new_token_ratio = self.config.init_new_token_ratio
            retracted.append(victim)
        if retracted:
            log.warning(
                "KV pages ran out: retracted %d request(s) (%s) to be recomputed; %d keep decoding",
                len(retracted),
                ", ".join(r.rid for r in retracted[:8]) + (" ..." if len(retracted) > 8 else ""),
                len(self.running),
            )
        for req in self.running:
            self.kv.extend(req.kv, 1)
        return list(self.running)

    def _pick_victim(self) -> Request:
        """Retract the request that loses least work (fewest outputs, then the longest prompt)
        among those of the worst priority (the largest ``priority`` value)."""
        return min(
            self.running,
            key=lambda r: (-r.params.priority, len(r.output_ids), -len(r.prompt_ids)),
        )

    def _retract(self, req: Request) -> None:
        """Back to the front of the waiting queue, to be recomputed (prompt + outputs so far);
        the KV it computed goes into the tree (not the slot this step's decode was given)."""
        self.running.remove(req)
        self.kv.close(req.kv, req.all_ids[: req.kv.computed_len], cache=True)
        req.seq = None
        req.status = RequestStatus.WAITING
        req.retractions += 1
        self.total_retractions += 1
        self.waiting.insert(0, req)
        self.admission.arrived(req, front=True)

    def _preempt_for(
        self, req: Request, ctx: PolicyContext, pages_short: int, slots_short: int
    ) -> list[Request] | None:
        """Retract the running requests the policy names for ``req``, as few as make room for
        ``pages_short`` pages and ``slots_short`` slots; none (None) when all of them would not."""
        if not self.policy.preempts or not self.running:
            return None
        candidates = self.policy.preempt_candidates(req, list(self.running), ctx)
        ratio, ps, cap = self.new_token_ratio, self.page_size, self.max_model_len
        chosen: list[Request] = []
        pages = slots = 0
        for victim in candidates:
            if victim.status is not RequestStatus.RUNNING or any(v is victim for v in chosen):
                raise ValueError(
                    f"policy {self.policy.name!r} named {victim.rid!r} to preempt, "
                    "which is not a running request (or named it twice)"
                )
            chosen.append(victim)
            # at least what retracting it frees: its own pages, the floor of its reservation
            pages += self.kv.own_pages(victim.kv) + int(victim.future_tokens(cap) * ratio / ps)
            slots += 1
            if pages >= pages_short and slots >= slots_short:
                break
        else:
            return None
        for victim in chosen:
            self._retract(victim)
            self.total_preemptions += 1
        log.info(
            "preempted %s for %s (policy %s)",
            ", ".join(v.rid for v in chosen),
            req.rid,
            self.policy.name,
        )
        return chosen

    def _admit(self, plan: BatchPlan, budget: StepBudget, num_decodes: int) -> Admission:
        """Fill ``plan.extends`` under the step's token budget and the KV memory check; return
        how admission went (why it stopped, whom it skipped) for the admission counts."""
        chunk = budget.chunk_size
        # With chunking on, the chunk bounds the whole step's prefill, not only one prompt's
        # piece of it (as SGLang's chunked_prefill_size): otherwise a step could carry one
        # prompt's last chunk, the next prompt's first and short prompts between them.
        remaining = min(budget.prefill_tokens, chunk) if chunk else budget.prefill_tokens
        if budget.total_tokens is not None:
            remaining = min(remaining, budget.total_tokens - num_decodes)
        ps = self.page_size
        dedup = self.step_prefixes
        if dedup is not None:
            dedup.clear()
        remaining, stopped = self._continue_prefills(plan, remaining, chunk)
        if stopped is not None:
            return Admission(stopped)
        if not self.waiting:
            return Admission()
        # nothing can be admitted: skip the policy's ordering work (unless it may preempt)
        if remaining <= 0:
            return Admission(TOKEN_BUDGET)
        if self.chunked is not None and chunk:
            return Admission(CHUNK_IN_FLIGHT)
        preempts = self.policy.preempts
        slots = self.config.max_running_requests - len(self.running) - len(self.prefilling)
        if slots <= 0 and not preempts:
            return Admission(RUNNING_CAP)
        reserved = self._reserved_tokens()
        alone = not self.running and not self.prefilling and not plan.extends
        if not alone and not preempts and self._reservation(reserved) + 1 > self.kv.available_pages:
            return Admission(KV_RESERVATION)  # not even a one-page request would fit
        # The policy orders the oldest ``policy_window`` requests; the rest wait in arrival
        # order, which bounds each step's ordering cost when the queue is very long.
        window = self.waiting[: self.config.policy_window]
        ctx = self._context(num_decodes)
        ordered = self.policy.order(window, ctx)
        admission = Admission(window=window)
        if len(ordered) < len(window):  # the policy holds the ones it left out
            kept = {id(req) for req in ordered}
            admission.held = [req for req in window if id(req) not in kept]
        if self.shadow is not None:
            self.shadow.compare(window, ordered, ctx)
        for req in ordered:
            if remaining <= 0:
                admission.stopped = TOKEN_BUDGET
                break
            if self.chunked is not None and chunk:
                admission.stopped = CHUNK_IN_FLIGHT  # at most one request mid-chunk
                break
            ids = req.all_ids
            matched = self.kv.match_length(ids)
            if dedup is not None and dedup.shares(ids, matched):
                # another prompt of this step computes the same uncached page: left waiting,
                # this one takes it (and whatever more they share) from the cache next step
                self.total_prefix_deferrals += 1
                admission.deferred.append(req)
                continue
            estimate = len(ids) - matched
            future = req.future_tokens(self.max_model_len)
            need = self.kv.pages_needed(None, estimate) + self._reservation(reserved + future)
            alone = not self.running and not self.prefilling and not plan.extends
            if not alone and (slots <= 0 or need > self.kv.available_pages):
                short = need - self.kv.available_pages
                victims = self._preempt_for(req, ctx, short, 1 - slots)
                if victims is None:
                    admission.stopped = RUNNING_CAP if slots <= 0 else KV_RESERVATION
                    break
                admission.preempted += victims
                slots += len(victims)
                reserved = self._reserved_tokens()  # without the victims' future tokens
                need = self.kv.pages_needed(None, estimate) + self._reservation(reserved + future)
                alone = not self.running and not self.prefilling and not plan.extends
                if not alone and need > self.kv.available_pages:
                    admission.stopped = KV_RESERVATION
                    break
            if not chunk and estimate > remaining and not alone:
                admission.stopped = TOKEN_BUDGET  # no chunking: a prompt over the budget runs alone
                break
            if chunk and ps <= estimate and remaining < ps and not alone:
                admission.stopped = TOKEN_BUDGET  # less than a page left: start it next step
                break
            take = self._start_prefill(plan, req, remaining, chunk)
            if take is None:
                admission.stopped = KV_RESERVATION
                break
            admission.admitted.append(req)
            remaining -= take
            slots -= 1
            reserved += future
        else:  # every ordered request was tried: say what would have stopped the next one
            if remaining <= 0:
                admission.stopped = TOKEN_BUDGET
            elif self.chunked is not None and chunk:
                admission.stopped = CHUNK_IN_FLIGHT
            elif slots <= 0:
                admission.stopped = RUNNING_CAP
        return admission

    def _chunk_take(self, todo: int, remaining: int, chunk: int) -> int:
        """Tokens of a prompt's ``todo`` this step computes: all without chunking, else what the
        budget and the chunk allow, cut to whole pages when the prompt does not end here."""
        take = min(todo, remaining, chunk) if chunk else todo
        if take < todo and take >= self.page_size:
            take = take // self.page_size * self.page_size
        return take

    def _continue_prefills(
        self, plan: BatchPlan, remaining: int, chunk: int
    ) -> tuple[int, str | None]:
        """The requests mid-prompt go first: their next chunks into ``plan``. Returns the prefill
        tokens left and, when one could not go on, why admission stops."""
        for req in list(self.prefilling):
            if remaining <= 0:
                return remaining, TOKEN_BUDGET
            take = self._chunk_take(req.num_tokens - req.kv.kv_len, remaining, chunk)
            computed = req.kv.kv_len
            if not self._try_extend(req, take):
                return remaining, KV_RESERVATION
            self._add_extend(plan, req, take)
            if self.step_prefixes is not None:
                self.step_prefixes.add(req.all_ids, computed)
            remaining -= take
        return remaining, None

    def _start_prefill(
        self, plan: BatchPlan, req: Request, remaining: int, chunk: int
    ) -> int | None:
        """Move a waiting request to prefilling with its first chunk in ``plan``; the tokens it
        takes, or None (nothing changed) when the KV pool cannot hold that chunk."""
        ids = req.all_ids
        req.seq = self.kv.open(ids)
        take = self._chunk_take(len(ids) - req.kv.kv_len, remaining, chunk)
        if not self._try_extend(req, take):
            self.kv.close(req.kv, [], cache=False)
            req.seq = None
            return None
        self.waiting.remove(req)
        req.status = RequestStatus.PREFILLING
        if req.retractions == 0:
            req.cached_tokens = req.kv.num_cached
        self.prefilling.append(req)
        self._add_extend(plan, req, take)
        if self.step_prefixes is not None:
            self.step_prefixes.add(ids, req.kv.num_cached)
        return take

    def _try_extend(self, req: Request, take: int) -> bool:
        try:
            self.kv.extend(req.kv, take)
            return True
        except OutOfPagesError:
            return False

    def _add_extend(self, plan: BatchPlan, req: Request, take: int) -> None:
        start = req.kv.kv_len - take
        done = req.kv.kv_len == req.num_tokens
        ids = req.all_ids[start : start + take]
        plan.extends.append(Segment(req.rid, req.kv.row, ids, start, sample=done))
        if done:
            plan.sampling.append(SamplingInfo(req.params, req.prompt_ids, req.output_ids))
            if self.chunked is req:
                self.chunked = None
        else:
            self.chunked = req

    # -- results --------------------------------------------------------------------------
    def commit(self, plan: BatchPlan, output: StepOutput) -> list[TokenEvent]:
        """Apply a finished step: its KV is written, sampled tokens appended, finished prompt
        chunks cached. Whether a token ends its request is the lifecycle's to say."""
        owners = self._owners(plan)
        self.inflight = None  # its KV is written now
        self._inflight_owners = {}
        self.policy.observe(plan, output.forward_seconds)
        if self.shadow is not None:
            self.shadow.observe(plan, output.forward_seconds)
        now = self.clock()
        events: list[TokenEvent] = []
        sampled = iter(zip(output.token_ids, output.logprobs, strict=True))
        for seg in plan.segments:
            req = owners.get(seg.rid)
            alive = req is not None and not req.finished  # else aborted while the step ran
            if req is not None and alive:
                req.kv.computed_len = seg.end_pos
            if not seg.sample:
                if req is not None and alive:  # the chunk is shareable now
                    self.kv.cache(req.kv, req.all_ids[: seg.end_pos])
                continue
            token, logprobs = next(sampled)
            if req is None or not alive:
                continue
            if req.status is RequestStatus.PREFILLING:
                self.prefilling.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                # the whole prompt is in KV now: share it while this request still decodes
                self.kv.cache(req.kv, req.all_ids[: seg.end_pos])
            req.output_ids.append(token)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            events.append(TokenEvent(req, token, logprobs))
        return events

    def fail(self, plan: BatchPlan) -> list[Request]:
        """The step's forward raised: end its requests (reason "abort") and return them.

        Their KV is not trusted, so nothing of theirs enters the prefix cache. The plan's page
        writes go back to the front of the log: the executor may not have applied them, and
        the next plan replays them (applying a write twice is harmless).
        """
        self.kv.page_table.requeue(plan.page_writes)
        failed = []
        owners = self._owners(plan)
        for seg in plan.segments:
            req = owners.get(seg.rid)
            if req is not None and not req.finished:
                self.finish(req, "abort", cache=False)
                failed.append(req)
        self.inflight = None
        self._inflight_owners = {}
        return failed

    def _owners(self, plan: BatchPlan) -> dict[str, Request | None]:
        """The request each segment of ``plan`` was planned for (None: it is gone)."""
        if plan is self.inflight:
            return self._inflight_owners
        return {seg.rid: self.requests.get(seg.rid) for seg in plan.segments}

    # -- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        kv = self.kv.stats()
        return {
            **kv,
            "running": len(self.running),
            "prefilling": len(self.prefilling),
            "waiting": len(self.waiting),
            "retractions": self.total_retractions,
            "preemptions": self.total_preemptions,
            "prefix_deferrals": self.total_prefix_deferrals,
            "policy_swaps": self.policy_swaps,
            "new_token_ratio": self.new_token_ratio,
            "steps": self.step_count,
        }
