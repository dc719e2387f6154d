"""priority: lower ``SamplingParams.priority`` first (vLLM's convention), ties by arrival.

With ``preempt = true`` a waiting request that KV memory or the running-request cap blocks may
have running requests of worse priority retracted for it (the scheduler does it: worst priority
first, then the one with the fewest outputs, which loses least work; it is recomputed later and
never emits a token twice). Requests of equal priority never preempt each other.

Strict priority starves the worst class under a steady stream of better ones (the starvation
check says so). ``max_wait_tokens`` > 0 bounds that: a request that has waited as long as the
engine takes to prefill that many tokens goes before every younger one, whatever its priority.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, take_options
from asyncengine.policies.prefill_rate import PrefillRate


class PriorityPolicy(Policy):
    name = "priority"
    orders = True
    sees_decodes = False  # its PrefillRate counts prefill steps only

    def __init__(self, **options: Any) -> None:
        opts = take_options(self.name, options, {"preempt": False, "max_wait_tokens": 0})
        if opts["max_wait_tokens"] < 0:
            raise ValueError("policy 'priority': 'max_wait_tokens' must be >= 0 (0: strict)")
        self.preempts = opts["preempt"]
        self.max_wait_tokens = opts["max_wait_tokens"]
        self.prefill_rate = PrefillRate()

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        self.prefill_rate.add(plan, seconds)

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        if len(waiting) < 2:
            return waiting
        cap, rate, now = self.max_wait_tokens, self.prefill_rate.tokens_per_second, ctx.now
        keyed: list[tuple[bool, int, float, int]] = []
        for index, req in enumerate(waiting):
            starving = cap > 0 and (now - req.arrival_time) * rate >= cap
            # the starving go first, oldest first, whatever their priority
            priority = 0 if starving else req.params.priority
            keyed.append((not starving, priority, req.arrival_time, index))
        keyed.sort()
        return [waiting[item[3]] for item in keyed]

    def preempt_candidates(
        self, candidate: Request | None, running: Sequence[Request], ctx: PolicyContext
    ) -> list[Request]:
        if candidate is None:  # KV shortage: the config's preemption_victim
            return super().preempt_candidates(None, running, ctx)
        if not self.preempts:
            return []
        worse = [r for r in running if r.params.priority > candidate.params.priority]
        worse.sort(key=lambda r: (-r.params.priority, len(r.output_ids), -r.arrival_time))
        return worse
