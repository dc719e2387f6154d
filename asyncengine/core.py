"""EngineCore: the one place an engine step is written (synchronous; no torch, no asyncio).

    core = build_core(config, executor)      # asyncengine/builder.py
    core.add(request)
    while core.has_work():
        result = core.step()                 # schedule -> executor.execute -> commit (or fail)

Every driver steps the engine through it: ``AsyncEngine`` (which runs ``execute`` on its forward
thread between ``schedule`` and ``commit``/``fail``, so it can overlap the next step with
streaming), the simulator and the sim-vs-real replay (``step`` on a virtual clock), and the
tests. Drivers own arrivals, clocks and output streams; what a step does to requests and KV
memory is here and in the scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncengine.cache.manager import KVCacheManager
from asyncengine.config import EngineConfig
from asyncengine.executor_api import Executor, ModelSpec
from asyncengine.plan import BatchPlan, StepOutput
from asyncengine.policies.base import Policy
from asyncengine.policies.registry import make_policy
from asyncengine.request import Request
from asyncengine.scheduler import Scheduler, TokenEvent
from asyncengine.tenant_stats import TenantStats

log = logging.getLogger("asyncengine.core")

COUNTERS = (
    "prompt_tokens",
    "generated_tokens",
    "finished_stop",
    "finished_length",
    "finished_abort",
    "finished_timeout",
    "failed",
)


@dataclass(slots=True)
class StepResult:
    """One step: its plan, the tokens it sampled, the requests it failed (forward raised) and
    those that ran out of time before it was planned (finish reason "timeout")."""

    plan: BatchPlan
    events: list[TokenEvent] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    error: Exception | None = None
    forward_seconds: float = 0.0
    expired: list[Request] = field(default_factory=list)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.step_hooks: list[Callable[[BatchPlan], None]] = []  # after every commit
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.tenants = TenantStats()

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

    def now(self) -> float:
        return self.scheduler.clock()

    # -- requests --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.scheduler.add_request(req)
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        self.tenants.added(req)

    def abort(self, rid: str) -> Request | None:
        """End ``rid`` with reason "abort"; its KV is released (its computed prefix stays cached)."""
        req = self.scheduler.requests.get(rid)
        if req is None:
            return None
        self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str, matched: str | int | None = None) -> None:
        """End ``req`` now (a stop string the output side found, an abort); no-op if it ended."""
        if req.finished:
            return
        self.scheduler.finish(req, reason, matched)
        self._count_finished(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> BatchPlan | None:
        """The next plan, or None when nothing can run now. Requests whose time ran out end
        first (reason "timeout"): ``expired`` lists them until the next call."""
        plan = self.scheduler.schedule()
        for req in self.scheduler.expired:
            self._count_finished(req)
            self.tenants.timed_out(req)
        if plan is not None and any(info.params.structured for info in plan.sampling):
            self._add_token_bitmasks(plan)
        return plan

    def _add_token_bitmasks(self, plan: BatchPlan) -> None:
        """Each structured-output row of the plan gets the tokens its grammar allows next (the
        grammar is at the request's last committed token: commit precedes the next schedule)."""
        sampled = (seg for seg in plan.segments if seg.sample)
        for seg, info in zip(sampled, plan.sampling, strict=True):
            grammar = self.scheduler.requests[seg.rid].grammar
            if grammar is not None:
                info.token_bitmask = grammar.next_bitmask()

    @property
    def expired(self) -> list[Request]:
        """The requests the last ``schedule()`` ended with reason "timeout"."""
        return self.scheduler.expired

    def set_policy(self, spec: str, options: dict[str, Any] | None = None) -> Policy:
        """Swap the ordering/budget policy at the next step boundary; running requests and KV
        memory are left as they are. A bad name or option raises ValueError (ConfigError) and
        changes nothing. Returns the new policy."""
        config = self.config.replace(policy=spec, policy_options=dict(options or {}))
        policy = make_policy(config.policy, config.policy_options)
        self.scheduler.config = config
        self.scheduler.set_policy(policy)
        log.info("policy %s takes over from %s at the next step", policy.name, self.policy.name)
        return policy

    def commit(self, plan: BatchPlan, output: StepOutput) -> list[TokenEvent]:
        """Apply a forward's output: tokens appended, stops checked, prefixes cached, grammars
        advanced (a grammar that completes ends its request with reason "stop")."""
        events = self.scheduler.commit(plan, output)
        for event in events:
            grammar = event.req.grammar
            if grammar is None or event.finished:
                continue
            if not grammar.accept(event.token_id):
                log.error("request %s: token %d breaks its grammar", event.req.rid, event.token_id)
                self.scheduler.finish(event.req, "abort")
                event.finished = True
            elif grammar.is_terminated():
                self.scheduler.finish(event.req, "stop", event.token_id)
                event.finished = True
        self.counters["generated_tokens"] += len(events)
        for event in events:
            if event.finished:
                self._count_finished(event.req)
        for hook in self.step_hooks:
            hook(plan)
        return events

    def fail(self, plan: BatchPlan, error: BaseException) -> list[Request]:
        """The forward of ``plan`` raised: its requests end (reason "abort", nothing cached)."""
        failed = self.scheduler.fail(plan)
        self.counters["failed"] += len(failed)
        for req in failed:
            self.tenants.generated(req, len(req.output_ids))
        log.error(
            "forward of step %d failed; failing its %d request(s)",
            plan.step,
            len(failed),
            exc_info=error,
        )
        return failed

    def step(self) -> StepResult | None:
        """Schedule, execute and commit one step on this thread; None when nothing can run."""
        plan = self.schedule()
        if plan is None:
            return None
        expired = list(self.expired)
        started = time.perf_counter()
        try:
            output = self.executor.execute(plan)
        except Exception as error:  # one bad forward fails its batch, not the engine
            return StepResult(plan, failed=self.fail(plan, error), error=error, expired=expired)
        if not output.forward_seconds:
            output.forward_seconds = time.perf_counter() - started
        events = self.commit(plan, output)
        return StepResult(plan, events, forward_seconds=output.forward_seconds, expired=expired)

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        sched = self.scheduler.stats()
        hit, miss = sched["hit_tokens"], sched["miss_tokens"]
        shadow = self.scheduler.shadow
        return {
            **sched,
            **self.counters,
            "cache_hit_rate": hit / (hit + miss) if hit + miss else 0.0,
            "policy": self.policy.name,
            "admission_blocked": dict(self.scheduler.admission.steps),
            "tenants": self.tenants.snapshot(),
            "shadow": None if shadow is None else shadow.stats(),
        }

    def reset_prefix_cache(self, reset_counters: bool = False) -> None:
        """Empty the radix cache (and optionally its hit/miss counters); only while idle."""
        if self.has_work():
            raise RuntimeError("cannot reset the prefix cache while requests are in the engine")
        self.kv.reset(reset_counters=reset_counters)

    def check_invariant(self) -> None:
        self.kv.check_invariant()

    def _count_finished(self, req: Request) -> None:
        key = f"finished_{req.finish_reason or 'abort'}"
        self.counters[key] = self.counters.get(key, 0) + 1
        self.tenants.generated(req, len(req.output_ids))  # a tenant's tokens count at the end
