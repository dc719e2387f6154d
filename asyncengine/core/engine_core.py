"""EngineCore: the one place an engine step is sequenced (synchronous; no torch, no asyncio).

    core = build_core(config, executor)      # asyncengine/core/builder.py
    core.add(request)
    while core.has_work():
        events = core.step()                 # launch -> execute -> land

A step is ``launch()`` (the deadlines that passed end, then the scheduler plans),
``execute(plan)`` (the structured-output rows' masks, then the executor's forward) and
``land(plan, output or error)`` (the scheduler commits, the lifecycle decides who ended);
``step()`` runs all three on this thread. Every driver uses these: ``AsyncEngine``
(``execute`` on its forward thread, so it can overlap the next launch with streaming, and a
slow grammar's masks hold up no HTTP client), the simulator and the sim-vs-real replay
(``step`` on a virtual clock), the replica simulator (a replica's ``land`` when the shared
virtual clock reaches it) and the tests. Drivers own arrivals, clocks and output streams;
what a step does to requests and KV memory is here, in the scheduler and in the lifecycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.pins import Pin
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, SamplingInfo, StepOutput
from asyncengine.common.request import Grammar, Request
from asyncengine.core.executor_api import Executor, ModelSpec, defers_inputs
from asyncengine.core.lifecycle import Lifecycle
from asyncengine.policies.base import Policy
from asyncengine.policies.eviction_registry import build_eviction_rule
from asyncengine.policies.registry import build_policy
from asyncengine.scheduler.scheduler import Scheduler
from asyncengine.scheduler.step_events import StepEvents

log = logging.getLogger("asyncengine.core.engine_core")


@dataclass(slots=True)
class _MaskRow:
    """A structured-output row of a plan: what its sampler gets, its request's grammar, and
    the guesses the row verifies (none without speculative decoding)."""

    info: SamplingInfo
    grammar: Grammar
    guesses: list[int]


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.lifecycle = Lifecycle(scheduler, executor.spec.eos_token_ids)
        # the pool's size in bytes (K and V of every layer, as its dtype stores them)
        self.kv_pool_bytes = (
            scheduler.kv.num_pages * scheduler.kv.page_size * executor.spec.kv_bytes_per_token
        )
        self.step_hooks: list[Callable[[BatchPlan], None]] = []  # after every landed step
        self._launched_at = 0.0  # perf_counter at the last launch
        # plan.step -> its structured-output rows, picked at launch on the driver's thread and
        # given their masks by execute, on the forward thread
        self._masks_due: dict[int, list[_MaskRow]] = {}

    # -- what it is made of ----------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.scheduler.config

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    @property
    def spec(self) -> ModelSpec:
        return self.executor.spec

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def counters(self) -> dict[str, int]:
        return self.lifecycle.counters

    def now(self) -> float:
        return self.scheduler.clock()

    # -- requests --------------------------------------------------------------------------
    def add(self, req: Request, followers: Sequence[Request] = ()) -> None:
        """Queue ``req``; ``followers`` (the other choices of an n > 1 request, same prompt)
        fork its prompt's pages once it has prefilled."""
        self.lifecycle.add(req, followers)

    def abort(self, rid: str) -> bool:
        """End ``rid`` with reason "abort"; its KV is released (its computed prefix stays
        cached). Reported by the next ``events()`` or ``land``."""
        return self.lifecycle.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------
    def launch(self) -> BatchPlan | None:
        """The next plan, or None when nothing can run now. The requests whose deadline has
        passed end first (reported with the next events). Its structured-output rows get
        their masks in ``execute``."""
        self.lifecycle.expire()
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        if any(info.params.structured for info in plan.sampling):
            self._masks_due[plan.step] = self._mask_rows(plan)
        self._launched_at = time.perf_counter()
        return plan

    def execute(self, plan: BatchPlan) -> StepOutput:
        """Run ``plan`` (from ``launch``) on this thread: each structured-output row's mask,
        then the executor's forward. A driver calls this on its forward thread: xgrammar
        releases the GIL while it makes a mask, so a grammar whose masks are slow (up to
        ``MAX_STEP_SECONDS`` of CPU each, then its request ends: structured/grammar.py) delays
        the step, while the event loop goes on streaming and admitting."""
        self.make_masks(plan)
        return self.executor.execute(plan)

    def make_masks(self, plan: BatchPlan) -> None:
        """``plan``'s structured-output rows (picked at its launch) get their masks, on this
        thread: what ``execute`` does first, for a driver that starts the forward its own way
        (the step loop's launch in two halves). Once per plan."""
        self._fill_masks(self._masks_due.pop(plan.step, []))

    def held_until(self) -> float | None:
        """While the policy holds every waiting request and nothing runs (the last launch ran
        nothing): when a launch may change that, the earliest of the policy's wake time, a
        waiting request's deadline and the end of ``max_policy_stall``. None: the policy holds
        nothing, or names no wake time ahead (a driver then asks again every
        ``IDLE_POLL_SECONDS``)."""
        sched = self.scheduler
        since = sched.stall.since
        if since is None:
            return None
        wake = sched.wake_time()
        if wake is None or wake <= self.now():
            return None
        limit = sched.config.max_policy_stall
        if limit:
            wake = min(wake, since + limit)
        deadline = self.lifecycle.next_deadline()
        return wake if deadline is None else min(wake, deadline)

    def can_launch_ahead(self) -> bool:
        """Whether ``launch`` may run now, before the plan in flight lands, with the same
        result as after it (overlap scheduling: scheduler/plan_ahead.py): the executor fills
        in the decode inputs the host has not seen yet."""
        return defers_inputs(self.executor) and self.scheduler.can_plan_ahead()

    def land(self, plan: BatchPlan, result: StepOutput | BaseException) -> StepEvents:
        """Apply what the forward of ``plan`` gave: its output (tokens appended, prefixes
        cached, every request its token ends ended), or its error (its requests fail, reason
        "abort", nothing cached: one bad forward fails its batch, not the engine)."""
        self._masks_due.pop(plan.step, None)  # a plan run without execute, or that failed
        if isinstance(result, BaseException):
            failed = self.scheduler.fail(plan)
            self.lifecycle.failed(failed)
            log.error(
                "forward of step %d failed; failing its %d request(s)",
                plan.step,
                len(failed),
                exc_info=result,
            )
            return self.lifecycle.report(plan, failed=failed, error=result)
        if not result.forward_seconds:
            result.forward_seconds = time.perf_counter() - self._launched_at
        tokens, prompts_done = self.scheduler.commit(plan, result)
        self.lifecycle.settle(tokens, prompts_done)
        for hook in self.step_hooks:
            hook(plan)
        return self.lifecycle.report(plan, tokens, forward_seconds=result.forward_seconds)

    def events(self) -> StepEvents:
        """What ended since the last report without a step landing (aborts, timeouts)."""
        return self.lifecycle.report()

    def step(self) -> StepEvents | None:
        """Launch, execute and land one step on this thread; None when nothing can run."""
        plan = self.launch()
        if plan is None:
            return None
        try:
            output = self.execute(plan)
        except Exception as error:
            return self.land(plan, error)
        return self.land(plan, output)

    def add_token_bitmasks(self, plan: BatchPlan) -> None:
        """The masks of a plan made outside ``launch`` (the simulator's bulk decode), now."""
        self._fill_masks(self._mask_rows(plan))

    def _mask_rows(self, plan: BatchPlan) -> list[_MaskRow]:
        """The plan's structured-output rows, with their requests' grammars (looked up here,
        on the driver's thread: an abort may drop a request before the masks are made)."""
        rows: list[_MaskRow] = []
        sampled = (seg for seg in plan.segments if seg.sample)
        for seg, info in zip(sampled, plan.sampling, strict=True):
            grammar = self.scheduler.requests[seg.rid].grammar
            if grammar is not None:
                guesses = seg.input_ids[-seg.guesses :] if seg.guesses else []
                rows.append(_MaskRow(info, grammar, guesses))
        return rows

    @staticmethod
    def _fill_masks(rows: list[_MaskRow]) -> None:
        """Each row gets the tokens its grammar allows next. The grammar is at the request's
        last landed token: a plan is made after the landing of the request's previous one (one
        made ahead holds no request with a grammar that decodes: scheduler/plan_ahead.py)."""
        for row in rows:
            row.info.token_bitmask = row.grammar.next_bitmask()
            if row.guesses:
                row.info.guess_bitmasks = _guess_bitmasks(
                    row.grammar, row.guesses, row.info.token_bitmask
                )

    def set_policy(self, spec: str, options: dict[str, Any] | None = None) -> str:
        """Swap the ordering/budget policy at the next step boundary; running requests and KV
        memory are left as they are. A bad name or option raises ConfigError (a ValueError)
        and changes nothing. Returns the name of the policy it replaces."""
        config = self.config.replace(policy=spec, policy_options=dict(options or {}))
        policy = build_policy(config.policy, config.policy_options)
        return self.scheduler.set_policy(policy, config)

    def set_eviction_policy(self, spec: str, options: dict[str, Any] | None = None) -> str:
        """Order the prefix cache's evictions by another rule from now on (between steps: the
        tree is the loop thread's); cached pages stay. A bad name or option raises
        ConfigError and changes nothing. Returns the name of the rule it replaces."""
        config = self.config.replace(
            eviction_policy=spec, eviction_policy_options=dict(options or {})
        )
        rule = build_eviction_rule(config.eviction_policy, config.eviction_policy_options)
        previous = self.kv.set_eviction_rule(rule)
        self.scheduler.config = config
        log.info("eviction policy %r replaces %r", spec, previous)
        return previous

    def pin(self, tokens: Sequence[int], ttl_s: float | None = None) -> Pin:
        """Keep the cached whole pages of ``tokens`` out of eviction, for ``ttl_s`` seconds
        (None: until ``unpin``); PinLimitError (a ValueError) past the pinned share or when
        nothing of them is cached."""
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        expires = None if ttl_s is None else self.now() + ttl_s
        return self.kv.pin(tokens, expires)

    def expire_pins(self) -> float | None:
        """Release the pins past their ``ttl_s`` (each step does too), and say when the next
        one ends (None: none has a ttl): a driver with no work wakes then to release it."""
        pins = self.kv.pins
        if len(pins):
            self.kv.expire_pins(self.now())
        return pins.next_expiry()

    def unpin(self, pin_id: int) -> Pin:
        """Release a pin (KeyError: no such pin, or it expired)."""
        return self.kv.unpin(pin_id)

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        sched = self.scheduler.stats()
        hit, miss = sched["hit_tokens"], sched["miss_tokens"]
        shadow = self.scheduler.shadow
        return {
            **sched,
            **self.lifecycle.counters,
            "kv_pool_bytes": self.kv_pool_bytes,
            "cache_hit_rate": hit / (hit + miss) if hit + miss else 0.0,
            "policy": self.policy.name,
            "planned_ahead_steps": self.scheduler.planned_ahead_steps,  # overlap scheduling
            "admission_blocked": dict(self.scheduler.admission.steps),
            "tenants": self.lifecycle.tenants.snapshot(),
            "shadow": None if shadow is None else shadow.stats(),
            "length_predictor": self.scheduler.lengths.stats(),
            "eviction_policy": self.kv.tree.rule.name,
            "eviction_rule": self.kv.tree.rule.stats(),
            "eviction_by_rule": self.kv.eviction_stats(),
            **self._speculation_stats(sched),
        }

    def _speculation_stats(self, sched: dict[str, float]) -> dict[str, Any]:
        """Speculative decoding: acceptance overall, accepted tokens per verifying step, and
        each running request's guesses verified and accepted so far."""
        if self.scheduler.speculation is None:
            return {}
        verified, accepted = sched["spec_verified_tokens"], sched["spec_accepted_tokens"]
        return {
            "spec_acceptance_rate": accepted / verified if verified else 0.0,
            "spec_accepted_per_step": accepted / sched["spec_steps"]
            if sched["spec_steps"]
            else 0.0,
            "spec_requests": {
                req.rid: {"proposed": req.proposed_guesses, "accepted": req.accepted_guesses}
                for req in self.scheduler.running
            },
        }

    def reset_prefix_cache(self, reset_counters: bool = False) -> None:
        """Empty the radix cache and the prompt score cache; only while idle. ``reset_counters``:
        the counts of ``stats()`` start again too (hits, requests, tokens, tenants, steps), so
        that a replay's warm-up stays out of the run it measures."""
        if self.has_work():
            raise RuntimeError("cannot reset the prefix cache while requests are in the engine")
        self.kv.reset(reset_counters=reset_counters)
        if reset_counters:
            self.lifecycle.forget_counts()
            self.scheduler.forget_counts()
        if self.scheduler.prompt_scores is not None:
            self.scheduler.prompt_scores.clear()

    def check_invariant(self) -> None:
        self.kv.check_invariant()


def _guess_bitmasks(grammar: Grammar, guesses: list[int], first: object) -> list[object]:
    """The mask after each guess, as if the guesses before it were accepted; from a guess the
    grammar refuses (or one that completes it) on, the last mask repeats: the sampler never
    takes a refused guess, so no row gets past it. The grammar is left as it was."""
    masks: list[object] = []
    taken = 0
    for guess in guesses:
        if grammar.is_terminated() or not grammar.accept(guess):
            break
        taken += 1
        if grammar.is_terminated():
            break
        masks.append(grammar.next_bitmask())
    if taken:
        grammar.rollback(taken)
    last = masks[-1] if masks else first
    return masks + [last] * (len(guesses) - len(masks))
