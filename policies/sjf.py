"""sjf: shortest predicted job first, with aging so long jobs still finish.

A job's predicted size is the prompt tokens still to compute (its length less what the prefix
cache holds) plus the output tokens it is predicted to generate still (the engine's
``length_predictor``; the default, ``max-tokens``, is its ``max_new_tokens``). A request's score is
its size less ``aging`` times its wait, the wait counted in work (the prompt tokens the engine
prefills meanwhile, as LPM counts it, see ``PrefillRate``): a long job overtakes a fresh short
one once it has waited ``aging`` x the difference. A request that has waited ``max_wait_tokens``
goes before every younger one, which bounds the wait of any job under any stream of short ones.
"""

from __future__ import annotations

from typing import Any

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, take_options
from asyncengine.policies.prefill_rate import PrefillRate


class SJFPolicy(Policy):
    name = "sjf"
    orders = True
    sees_decodes = False  # its PrefillRate counts prefill steps only

    def __init__(self, **options: Any) -> None:
        opts = take_options(self.name, options, {"aging": 1.0, "max_wait_tokens": 1_000_000})
        if opts["aging"] < 0 or opts["max_wait_tokens"] < 1:
            raise ValueError(
                f"policy {self.name!r}: 'aging' must be >= 0 and 'max_wait_tokens' >= 1"
            )
        self.aging = opts["aging"]
        self.max_wait_tokens = opts["max_wait_tokens"]
        self.prefill_rate = PrefillRate()

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        self.prefill_rate.add(plan, seconds)

    def job_tokens(self, req: Request, ctx: PolicyContext) -> float:
        return len(req.cache_ids) - ctx.cached_prefix(req) + self.output_tokens(req, ctx)

    def output_tokens(self, req: Request, ctx: PolicyContext) -> float:
        """Output tokens ``req`` is predicted to generate still."""
        return max(0.0, ctx.predicted_len(req) - len(req.output_ids))

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        if len(waiting) < 2:
            return waiting
        rate, now = self.prefill_rate.tokens_per_second, ctx.now
        aging, cap = self.aging, self.max_wait_tokens
        keyed: list[tuple[bool, float, float, int]] = []
        for index, req in enumerate(waiting):
            waited = (now - req.arrival_time) * rate
            starving = waited >= cap
            score = self.job_tokens(req, ctx) - aging * waited
            keyed.append(
                (not starving, req.arrival_time if starving else score, req.arrival_time, index)
            )
        keyed.sort()
        return [waiting[item[3]] for item in keyed]
