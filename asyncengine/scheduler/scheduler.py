"""Scheduler: turns waiting and running requests into BatchPlans, and commits their results.

Shared by every policy: the policy only orders the waiting queue and sets the step's token
budgets. The scheduler admits under those budgets and a KV memory check, chunks long
prefills (at most one request mid-chunk, and it goes first), mixes decodes into prefill
steps, retracts running requests when decode runs out of KV pages (or when a preempting
policy names them for a blocked waiting request), counts why admission stopped each step
(admission.py), and keeps the radix cache in step with every request's life. Which requests
end, and why, is the lifecycle's decision (lifecycle.py); ``finish`` releases them here. It
never touches tensors.

It holds the parts that do the work, and the queues they share: each step an ``Admitter``
(admitter.py) admits under the step's budget, ``Prefill`` (prefill.py) computes prompts chunk
by chunk, and ``Retraction`` (retraction.py) makes room when KV memory runs short.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.prompt_scores import PromptScoreCache
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, SamplingInfo, StepOutput
from asyncengine.common.request import Request, RequestStatus
from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from asyncengine.policies.fcfs import FCFSPolicy
from asyncengine.policies.length_predictor import LengthPredictions, MaxTokensPredictor
from asyncengine.scheduler.admission import (
    DECODE_TURN,
    POLICY_REASONS,
    Admission,
    AdmissionLog,
    stop_reason,
)
from asyncengine.scheduler.admitter import Admitter
from asyncengine.scheduler.lora_slots import LoraSlots
from asyncengine.scheduler.plan_ahead import (
    add_deferred_decodes,
    decodes_ahead,
    plan_ahead_allowed,
)
from asyncengine.scheduler.policy_guard import (
    IdleBlock,
    PolicyStall,
    SlowHooks,
    blocked_message,
    budget_of,
    stalled_error,
    wake_time_of,
)
from asyncengine.scheduler.prefill import Prefill
from asyncengine.scheduler.prompt_scoring import tail_scores
from asyncengine.scheduler.retraction import Retraction
from asyncengine.scheduler.shadow import ShadowPolicy
from asyncengine.scheduler.speculation import decode_segment, propose_guesses
from asyncengine.scheduler.step_commit import Committed, commit_segments, first_ids
from asyncengine.scheduler.step_prefixes import StepPrefixes
from asyncengine.scheduler.step_shares import StepShares
from asyncengine.scheduler.waiting_queue import WaitingQueue

log = logging.getLogger("asyncengine.scheduler.scheduler")


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
        lengths: LengthPredictions | None = None,
    ) -> None:
        self.config = config
        # the output-length predictor's answers, asked by policies through the context
        self.lengths = lengths or LengthPredictions(MaxTokensPredictor())
        self.kv = kv
        self.policy = policy
        self.shadow = shadow
        self._next_policy: PendingPolicy | None = None  # takes over at the next schedule()
        self.policy_swaps = 0
        self.policy_failures = 0  # hooks that raised or answered what cannot be (policy_guard)
        self._failed_policy: Policy | None = None  # the last policy that failed (replaced)
        # steps where the policy held every waiting request while nothing ran (policy_guard.py)
        self.stall = PolicyStall()
        self.slow_hooks = SlowHooks()  # reports a policy's first slow order() or budget()
        # steps that ran nothing while requests waited, blocked by something else (KV memory)
        self.idle_block = IdleBlock()
        # past max_policy_stall: raise PolicyStalledError (the simulator) instead of FCFS
        self.stall_raises = False
        self.max_model_len = max_model_len
        self.clock = clock
        self.page_size = kv.page_size
        self.waiting = WaitingQueue()
        self.prefilling: list[Request] = []  # admitted; prompt not fully computed
        self.running: list[Request] = []  # decoding
        self.requests: dict[str, Request] = {}
        self.new_token_ratio = config.init_new_token_ratio
        self.step_count = 0
        self.consecutive_prefill_steps = 0
        self.total_prefix_deferrals = 0
        self.admission = AdmissionLog()
        # speculative decoding (None: off); this step's guesses by rid (method "draft": how
        # many the executor's draft model guesses); totals over all steps
        self.speculation = config.speculation
        self.step_guesses: dict[str, list[int]] = {}
        self.step_drafts: dict[str, int] = {}
        self.spec_steps = 0  # steps that verified guesses
        self.spec_verified = 0  # guessed tokens verified
        self.spec_accepted = 0  # guessed tokens accepted
        self.inflight: BatchPlan | None = None  # the oldest plan launched and not landed
        # rid -> request of the plan in flight. A request aborted while its step
        # runs leaves ``requests``, and a new one may take its id at once: commit and fail go
        # by these objects, so the old step's token never lands on the new request.
        self._inflight_owners: dict[str, Request | None] = {}
        # overlap scheduling: the plan made while ``inflight`` had not landed (plan_ahead.py)
        self.ahead: BatchPlan | None = None
        self._ahead_owners: dict[str, Request | None] = {}
        self.planned_ahead_steps = 0
        # the uncached prefixes this step's prefills compute, when in-batch dedup is on
        self.step_prefixes: StepPrefixes | None = None
        # the running requests' future tokens when something else counts their progress (the
        # simulator's bulk decoding: sim/bulk_decode.py); None: summed from the requests
        self.running_future_tokens: Callable[[], int] | None = None
        # prompts of a step that share uncached tokens: one computes them (step_shares.py)
        self.step_shares: StepShares | None = None
        if config.enable_in_step_prefix_sharing and kv.enable_prefix_cache:
            self.step_shares = StepShares(self.page_size)
        if config.enable_inbatch_prefix_dedup and kv.enable_prefix_cache:
            # below a page, sharing in the step beats waiting a step for a kept tail
            self.step_prefixes = StepPrefixes(self.page_size, self.step_shares is None)
        # scores of scored prompts' pages, so a prompt sharing a scored prefix computes only
        # the rest (cache/prompt_scores.py)
        self.prompt_scores: PromptScoreCache | None = None
        if config.prompt_score_cache_pages > 0 and kv.enable_prefix_cache:
            self.prompt_scores = PromptScoreCache(self.page_size, config.prompt_score_cache_pages)
        self.retraction = Retraction(kv, self.waiting, self.running, self.policy_failed)
        # distinct LoRA adapters of the requests a step may hold, kept <= max_loras
        self.lora_slots = LoraSlots(config.max_loras, self.running, self.prefilling)
        self.prefill = Prefill(
            kv,
            self.waiting,
            self.prefilling,
            self.retraction.swapped,
            self.step_prefixes,
            self.step_shares,
            self.prompt_scores,
        )

    @property
    def chunked(self) -> Request | None:
        """The one request mid-chunk (Prefill's)."""
        return self.prefill.chunked

    def forget_counts(self) -> None:
        """Count steps, admission blocks and speculation again from zero (a replay's warm-up
        kept out of its measured run)."""
        self.step_count = 0
        self.admission.steps = dict.fromkeys(self.admission.steps, 0)
        self.spec_steps = self.spec_verified = self.spec_accepted = 0

    # -- queue ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in the engine")
        req.status = RequestStatus.WAITING
        self.requests[req.rid] = req
        self.waiting.append(req)
        self.admission.arrived(req)
        if req.params.lora is not None:
            self.lora_slots.any_lora = True

    def blocked(self, req: Request) -> dict[str, int]:
        """Steps ``req`` has waited so far, by admission-block reason (admission.py)."""
        return self.admission.settle(req)

    def set_policy(self, policy: Policy, config: EngineConfig) -> str:
        """Hand ordering and budgets to ``policy`` (named by ``config``) from the next
        schedule() on: a step boundary, where running requests, their KV and the request
        mid-chunk are the scheduler's, not the policy's, and stay as they are. A swap still
        pending is replaced (it never ran). Returns the name of the policy it replaces: the
        pending one, else the one running (what ``/admin/policy`` showed before)."""
        previous = self.policy_in_charge().policy
        self._next_policy = PendingPolicy(policy, config)
        self.policy_swaps += 1
        log.info("policy %r replaces %r at the next step", config.policy, previous)
        return previous

    def policy_in_charge(self) -> EngineConfig:
        """The config naming the policy in charge from the next step: a pending swap's (FCFS's
        once a policy failed), else the running one's."""
        pending = self._next_policy
        return pending.config if pending is not None else self.config

    def policy_failed(self, hook: str, exc: BaseException) -> None:
        """A hook of the live policy (or of the shadow: ``hook`` "shadow") raised or answered
        what cannot be: logged with its traceback and counted; FCFS replaces the policy from
        the next step (a failed shadow is dropped at once). The step goes on as FCFS would."""
        self.policy_failures += 1
        if hook == "shadow":
            shadow, self.shadow = self.shadow, None
            name = shadow.policy.name if shadow is not None else "?"
            log.error("shadow policy %r failed; it is dropped: %s", name, exc, exc_info=exc)
            return
        policy = self.policy
        if self._failed_policy is policy:
            return  # reported already: FCFS takes over at the next step
        self._failed_policy = policy
        log.error(
            "policy %r %s; FCFS takes over from the next step: %s",
            policy.name,
            "stalled" if hook == "stall" else f"failed in {hook}()",
            exc,
            exc_info=exc,
        )
        fallback = self.config.replace(policy="fcfs", policy_options={})
        self.set_policy(FCFSPolicy(), fallback)

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
            if not self.waiting:  # nothing is held or blocked any more
                if self.stall.since is not None:
                    self.stall.ended(self.clock())
                self.idle_block.ended()
        elif req.status is RequestStatus.PREFILLING:
            self.prefilling.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self.prefill.forget(req)
        if req.seq is not None:
            computed = req.seq.computed_len
            scores = tail_scores(req, computed // self.page_size * self.page_size)
            self.kv.close(req.seq, first_ids(req, computed), cache=cache, tail_scores=scores)
            req.seq = None
        self.retraction.forget(req)
        req.mark_finished(reason, matched, self.clock())
        self.lengths.finished(req)
        del self.requests[req.rid]
        self.admission.left(req)
        try:
            self.policy.finished(req)
        except Exception as exc:
            self.policy_failed("finished", exc)
        if self.shadow is not None:
            try:
                self.shadow.finished(req)
            except Exception as exc:
                self.policy_failed("shadow", exc)

    # -- planning -------------------------------------------------------------------------
    def _context(self, num_decodes: int) -> PolicyContext:
        return PolicyContext(
            config=self.config,
            now=self.clock(),
            num_running=len(self.running) + len(self.prefilling),
            num_decodes=num_decodes,
            prefix_len=self.kv.match_length,
            chunked=self.prefill.chunked,
            speculation=self.speculation,
            predicted_len=self.lengths.predicted_len,
            prefix_epoch=self.kv.prefix_epoch,
            cache_epoch=self.kv.cache_epoch(),
            step_loras=self.lora_slots.in_step,
            kept_prefix_len=self.prefill.cached_len,
        )

    def _reserved_tokens(self) -> int:
        """Future tokens of every admitted request, before ``new_token_ratio``."""
        cap = self.max_model_len
        counted = self.running_future_tokens
        reserved = (
            counted() if counted is not None else sum(r.future_tokens(cap) for r in self.running)
        ) + sum(r.future_tokens(cap) for r in self.prefilling)
        if self.speculation is not None:  # slots for the guesses a step verifies
            reserved += self.speculation.num_speculative_tokens * len(self.running)
        return reserved

    def schedule(self) -> BatchPlan | None:
        """Build the next step's plan, or None when there is nothing to run."""
        plan = self.begin_step()
        mixed = self.config.enable_mixed_batch
        starved = self.consecutive_prefill_steps >= self.config.max_consecutive_prefill_steps
        prefill_wanted = bool(self.waiting or self.prefilling)
        decoding: list[Request] = []
        admission = Admission(DECODE_TURN)
        if mixed or not prefill_wanted or (starved and self.running):
            decoding = self._prepare_decodes()
        if prefill_wanted and (mixed or not decoding):
            # the token budget counts every verified token: a decode's guesses too
            decode_tokens = (
                len(decoding)
                + sum(map(len, self.step_guesses.values()))
                + sum(self.step_drafts.values())
            )
            admission = self.admit(plan, decode_tokens)
        if not decoding and not plan.extends and self.running and not mixed:
            decoding = self._prepare_decodes()  # nothing admitted: decode
            if not decoding and prefill_wanted:  # it retracted everything: memory is free now
                admission = self.admit(plan, 0)
        if admission.preempted:  # a policy had some of this step's decodes retracted
            decoding = [req for req in decoding if req.status is RequestStatus.RUNNING]
        if self.inflight is not None:
            add_deferred_decodes(plan, decoding, self.inflight)
        else:
            for req in decoding:
                guesses, draft = self.step_guesses.get(req.rid), self.step_drafts.get(req.rid, 0)
                plan.decodes.append(decode_segment(req, guesses, draft))
                plan.sampling.append(SamplingInfo(req.params, req.prompt_ids, req.output_ids))
        if plan.is_empty():
            self.count_step(False, False)
            self._idle(admission)
            return None
        self.end_step(plan, admission, bool(plan.decodes))
        return plan

    def _idle(self, admission: Admission) -> None:
        """A step that runs nothing (its admission went as ``admission``): while requests wait
        and nothing runs, counted as a policy stall when the policy is why admission stopped
        (past ``max_policy_stall`` a failure), else as an ``IdleBlock`` (policy_guard.py)."""
        now = self.clock()
        if not self.waiting or self.running or self.prefilling or self.inflight is not None:
            self.stall.ended(now)
            self.idle_block.ended()
            return
        reason = stop_reason(admission, len(self.waiting) - len(admission.window))
        if reason is not None and reason not in POLICY_REASONS:
            self.stall.ended(now)  # the policy holds nothing: no other would admit one now
            self._blocked(reason, now)
            return
        self.idle_block.ended()
        lasted = self.stall.held(now)
        limit = self.config.max_policy_stall
        if limit and lasted >= limit:
            self.stall.ended(now)
            error = stalled_error(
                self.policy, lasted, self.waiting.oldest(self.config.policy_window)
            )
            if self.stall_raises:
                raise error
            self.policy_failed("stall", error)

    def _blocked(self, reason: str, now: float) -> None:
        """A step that ran nothing, blocked by ``reason`` (not the policy): past
        ``max_policy_stall`` of that, logged once, naming it."""
        block = self.idle_block
        lasted = block.blocked(reason, now)
        limit = self.config.max_policy_stall
        if limit and lasted >= limit and not block.reported:
            block.reported = True
            kv, waiting = self.kv, len(self.waiting)
            message = blocked_message(
                reason, self.policy, lasted, waiting, kv.pins.pages, kv.num_pages
            )
            log.warning("%s", message)

    def wake_time(self) -> float | None:
        """When the policy, holding every waiting request while nothing runs, may admit one
        (``Policy.wake_time``); None when it does not say (or its answer fails)."""
        policy = self.policy
        if type(policy).wake_time is Policy.wake_time:
            return None
        try:
            return wake_time_of(policy, self._context(0))
        except Exception as exc:
            self.policy_failed("wake_time", exc)
            return None

    def begin_step(self) -> BatchPlan:
        """The next step's empty plan; a policy handed over by ``set_policy`` takes over."""
        if self._next_policy is not None:
            self.policy, self.config = self._next_policy
            self._next_policy = None
            self.speculation = self.config.speculation
            self.lora_slots.max_loras = self.config.max_loras
        self.step_count += 1
        self.lora_slots.new_step()
        if len(self.kv.pins):
            self.kv.expire_pins(self.clock())
        rule = self.kv.tree.rule
        if rule.watches_queue:  # queue-aware eviction: what waiting prompts use (none: none)
            waiting = self.waiting.oldest(rule.queue_window) if self.waiting else []
            rule.watch_waiting([req.cache_ids for req in waiting])
        self.step_guesses = {}
        self.step_drafts = {}
        return BatchPlan(step=self.step_count)

    def count_step(self, extends: bool, decodes: bool) -> None:
        """The run of prefill-only steps and the new-token ratio after a step with (or
        without) prompts and decodes."""
        if extends and not decodes:
            self.consecutive_prefill_steps += 1
        else:
            self.consecutive_prefill_steps = 0
        if decodes and not extends:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )

    def end_step(self, plan: BatchPlan, admission: Admission, decodes: bool) -> None:
        """Count a step that runs (``decodes``: it decodes, in the plan or counted apart) and
        how its admission went; drain the KV changes the executor applies into ``plan``, and
        put it in flight."""
        self.count_step(bool(plan.extends), decodes)
        self.admission.record(self.waiting, admission)
        if self.stall.since is not None:
            self.stall.ended(self.clock())
        if self.idle_block.since is not None:
            self.idle_block.ended()
        kv = self.kv
        plan.page_writes = kv.page_table.drain_writes()
        plan.released_rows = kv.page_table.drain_released()
        plan.page_copies = kv.drain_page_copies()
        if kv.swap is not None:
            plan.swap_out, plan.swap_in = kv.swap.drain()
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
        if self.inflight is None:
            self.inflight = plan
            self._inflight_owners = owners
        else:  # planned ahead of the plan in flight (can_plan_ahead)
            if self.ahead is not None:
                raise RuntimeError(f"step {plan.step}: two plans in flight already")
            self.ahead = plan
            self._ahead_owners = owners
            self.planned_ahead_steps += 1

    def can_plan_ahead(self) -> bool:
        """Whether the next plan can be made now, before the plan in flight lands, and run
        exactly as if made after it (plan_ahead.py)."""
        inflight = self.inflight
        if inflight is None or self.ahead is not None:
            return False
        return plan_ahead_allowed(self.running, self.speculation is not None, self.policy, self.kv)

    def step_budget(self, num_decodes: int) -> StepBudget:
        """The policy's token budget for a step with ``num_decodes`` decode tokens."""
        policy, config = self.policy, self.config
        if type(policy).budget is not Policy.budget:
            try:
                return budget_of(policy, self._context(num_decodes), self.slow_hooks)
            except Exception as exc:
                self.policy_failed("budget", exc)
        return StepBudget(config.max_prefill_tokens, None, config.chunked_prefill_size)

    def admit(self, plan: BatchPlan, num_decodes: int) -> Admission:
        """Fill ``plan.extends`` under the step's budget and the KV memory check (admitter.py);
        return how admission went (why it stopped, whom it skipped) for the admission counts."""
        admission = self.admitter(plan, num_decodes).admit()
        self.total_prefix_deferrals += len(admission.deferred)
        for req in admission.preempted:  # retracted for it: back at the queue's front
            self.admission.arrived(req, front=True)
        return admission

    def admitter(self, plan: BatchPlan, num_decodes: int) -> Admitter:
        """This step's admission, under the policy's budget for it."""
        return Admitter(
            plan,
            self.step_budget(num_decodes),
            num_decodes,
            self.prefill,
            self.retraction,
            self.policy,
            self.config,
            self.shadow,
            self.admission,
            self._context,
            self._reserved_tokens,
            self.new_token_ratio,
            self.max_model_len,
            self.lora_slots,
            self.policy_failed,
            self.slow_hooks,
        )

    def _prepare_decodes(self) -> list[Request]:
        """Give every running request a KV slot for its next token (and its guesses, with
        speculative decoding), retracting when short (retraction.py)."""
        if self.inflight is not None:  # planned ahead: no guesses, room checked
            return decodes_ahead(self.running, self.inflight, self.kv, self.max_model_len)
        room = min(self.max_model_len, self.kv.max_tokens_per_request) - 1
        guesses, drafts = propose_guesses(
            self.speculation, self.running, self.policy, self._context, room
        )
        self.step_guesses, self.step_drafts = guesses, drafts
        retraction = self.retraction
        retracted = retraction.make_decode_room(
            guesses, drafts, self.policy, self.config, self._context
        )
        if retracted:
            self.new_token_ratio = self.config.init_new_token_ratio
            for req in retracted:  # back at the queue's front
                self.admission.arrived(req, front=True)
        return list(self.running)

    # -- results --------------------------------------------------------------------------
    def commit(self, plan: BatchPlan, output: StepOutput) -> Committed:
        """Apply a finished step: its KV is written, sampled tokens appended, finished prompt
        chunks cached, pooled parts added to their embeddings. Whether a token ends its
        request is the lifecycle's to say."""
        owners = self._owners(plan)
        self._landed(plan)  # its KV is written now
        self.retraction.count_computed(plan, owners, output.swap_seconds)
        try:
            self.policy.observe(plan, output.forward_seconds)
        except Exception as exc:
            self.policy_failed("observe", exc)
        if self.shadow is not None:
            try:
                self.shadow.observe(plan, output.forward_seconds)
            except Exception as exc:
                self.policy_failed("shadow", exc)
        if plan.num_guesses or any(output.drafted):
            self.spec_steps += 1
        events, prompts_done, verified, accepted = commit_segments(
            plan, output, owners, self.kv, self.prompt_scores, self.prefilling, self.running,
            self.clock(),
        )  # fmt: skip
        self.spec_verified += verified
        self.spec_accepted += accepted
        return Committed(events, prompts_done)

    def fail(self, plan: BatchPlan) -> list[Request]:
        """The step's forward raised: end its requests (reason "abort") and return them.

        Their KV is not trusted, so nothing of theirs enters the prefix cache. The plan's page
        writes go back to the front of the log: the executor may not have applied them, and
        the next plan replays them (applying a write twice is harmless).
        """
        self.kv.page_table.requeue(plan.page_writes)
        self.kv.page_table.requeue_released(plan.released_rows)
        failed = []
        owners = self._owners(plan)
        for seg in plan.segments:
            req = owners.get(seg.rid)
            if req is not None and not req.finished:
                self.finish(req, "abort", cache=False)
                failed.append(req)
        self._landed(plan)
        return failed

    def _landed(self, plan: BatchPlan) -> None:
        """``plan`` is out of flight; the plan made ahead of it (if any) is the one in flight."""
        if plan is self.ahead:
            raise RuntimeError(f"step {plan.step} landed before the plan in flight before it")
        if plan is self.inflight:
            self.inflight, self._inflight_owners = self.ahead, self._ahead_owners
        else:  # a plan the scheduler did not put in flight (the simulator's bulk steps)
            self.inflight, self._inflight_owners = None, {}
        self.ahead, self._ahead_owners = None, {}

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
            "retractions": self.retraction.total_retractions,
            "preemptions": self.retraction.total_preemptions,
            "prefix_deferrals": self.total_prefix_deferrals,
            "failed_admissions": self.prefill.failed_starts,
            "policy_swaps": self.policy_swaps,
            "policy_failures": self.policy_failures,
            # steps that ran nothing because the policy held every waiting request while
            # nothing ran, and the seconds the engine so sat idle (policy_guard.py)
            "policy_idle_holds": self.stall.holds,
            "policy_idle_seconds": self.stall.seconds_until(self.clock()),
            "spec_steps": self.spec_steps,
            "spec_verified_tokens": self.spec_verified,
            "spec_accepted_tokens": self.spec_accepted,
            **self.retraction.preemption_stats(),
            **(self.prompt_scores.stats() if self.prompt_scores is not None else {}),
            "new_token_ratio": self.new_token_ratio,
            "steps": self.step_count,
        }
