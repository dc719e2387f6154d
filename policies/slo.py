"""slo: serve against latency targets, ``ttft_ms`` (arrival to first token) and ``itl_ms``
(between tokens), using the step-time model dynamic chunking fits (``LatencyModel``).

Order: by slack against the TTFT target, least first: ``arrival + ttft - now - predicted
prefill time`` (the prompt tokens still to compute, through the fitted model). Requests that can
no longer make their target go after those that still can, oldest first, so a burst of hopeless
requests does not make every later one miss too. A request that has waited ``max_wait_tokens``
(in prefilled work, as LPM counts it) goes first whatever its slack: no request starves.

Budget: with requests decoding, each step's prefill is the most tokens (on top of the prefix of
the prompt mid-chunk) the model says fit in the ITL target beside this step's decodes, at least
``min_chunk``; with nothing decoding, the config's budget (only TTFT is at stake).

Hold (``hold = true``): when the decodes alone of one more running request would already make a
step longer than the ITL target, new requests wait (reason "policy_hold") rather than slowing
every running one down; a request that has waited ``max_wait_tokens`` is never held.

Until the model has seen ``min_samples`` prefill steps it predicts nothing: the order is by
deadline alone and the budget is the config's. With neither target (both default to 0) it
schedules as fcfs, and says so when it is built.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, StepBudget, take_options
from asyncengine.policies.latency_model import LatencyModel
from asyncengine.policies.prefill_rate import PrefillRate

log = logging.getLogger("asyncengine.policies")


class SLOPolicy(Policy):
    name = "slo"
    orders = True
    budgets = True

    def __init__(self, **options: Any) -> None:
        opts = take_options(
            self.name,
            options,
            {
                "ttft_ms": 0.0,  # 0: no TTFT target (arrival order)
                "itl_ms": 0.0,  # 0: no ITL target (the config's budget, no hold)
                "min_chunk": 32,
                "hold": True,
                "max_wait_tokens": 1_000_000,
                "window": 256,
                "min_samples": 8,
            },
        )
        if opts["ttft_ms"] < 0 or opts["itl_ms"] < 0:
            raise ValueError("policy 'slo': 'ttft_ms' and 'itl_ms' must be >= 0 (0: no target)")
        if opts["min_chunk"] < 1 or opts["max_wait_tokens"] < 1:
            raise ValueError("policy 'slo': 'min_chunk' and 'max_wait_tokens' must be >= 1")
        self.ttft = opts["ttft_ms"] / 1e3
        self.itl = opts["itl_ms"] / 1e3
        if not (self.ttft or self.itl):
            log.warning(
                "policy 'slo' has no target (ttft_ms and itl_ms are 0): it schedules as fcfs; "
                "set them in policy_options, as configs/slo.toml does"
            )
        self.min_chunk = opts["min_chunk"]
        self.hold = opts["hold"]
        self.max_wait_tokens = opts["max_wait_tokens"]
        self.model = LatencyModel(opts["window"], opts["min_samples"])
        self.prefill_rate = PrefillRate()

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        self.model.observe(plan, seconds)
        self.prefill_rate.add(plan, seconds)

    def _starving(self, req: Request, ctx: PolicyContext) -> bool:
        rate = self.prefill_rate.tokens_per_second
        return bool((ctx.now - req.arrival_time) * rate >= self.max_wait_tokens)

    def _held(self, ctx: PolicyContext) -> bool:
        """One more running request's decode alone would break the ITL target."""
        if not (self.hold and self.itl and self.model.fitted and ctx.num_running):
            return False
        return bool(self.model.decode_seconds(ctx.num_running + 1) > self.itl)

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        if self._held(ctx):
            return [req for req in waiting if self._starving(req, ctx)]
        if len(waiting) < 2:
            return waiting
        keyed: list[tuple[bool, bool, float, int]] = []
        for index, req in enumerate(waiting):
            starving = self._starving(req, ctx)
            if not self.ttft:
                keyed.append((not starving, False, req.arrival_time, index))
                continue
            todo = len(req.cache_ids) - ctx.cached_prefix(req)
            slack = req.arrival_time + self.ttft - ctx.now - self.model.prefill_seconds(todo)
            late = slack < 0
            key = req.arrival_time if starving or late else slack
            keyed.append((not starving, late, key, index))
        keyed.sort()
        return [waiting[item[3]] for item in keyed]

    def budget(self, ctx: PolicyContext) -> StepBudget:
        config = ctx.config
        default = Policy.budget(self, ctx)
        if not self.itl or not ctx.num_decodes or not self.model.fitted:
            return default
        prefix = ctx.chunked.kv_len if ctx.chunked is not None else 0
        left = self.itl - self.model.decode_seconds(ctx.num_decodes)
        tokens = self.model.tokens_within(left, prefix)
        page = max(config.page_size, 1)
        ceiling = config.chunked_prefill_size or config.max_prefill_tokens
        chunk = min(max(tokens, self.min_chunk, page), ceiling, config.max_prefill_tokens)
        chunk = max(page, chunk // page * page)
        return StepBudget(prefill_tokens=chunk, total_tokens=None, chunk_size=chunk)
