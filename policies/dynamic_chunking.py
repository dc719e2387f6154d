"""dynamic-chunking: pick each prefill chunk's length so every chunk costs about the same time.

Prefilling a chunk of ``x`` tokens on top of a prefix of ``l`` tokens costs attention work
proportional to ``2*l*x + x*x`` and linear work proportional to ``x``. The policy fits

    step_seconds = a * sum(2*l*x + x*x) + b * sum(x) + c * decodes + d

to the measured steps (least squares over a sliding window), then solves
``a*(2*l*x + x*x) + b*x = target`` for ``x``, where ``target`` is the fitted cost of one
``base_chunk`` at prefix 0. Later chunks of a long prompt therefore shrink as its prefix grows.
The answer is clamped to ``[min_chunk, max_chunk]``, page aligned, and smoothed (EMA).
"""

from __future__ import annotations

from typing import Any

from asyncengine.common.plan import BatchPlan
from asyncengine.policies.base import Policy, PolicyContext, StepBudget, take_options
from asyncengine.policies.latency_model import LatencyModel


class DynamicChunkingPolicy(Policy):
    name = "dynamic-chunking"
    budgets = True

    def __init__(self, **options: Any) -> None:
        opts = take_options(
            self.name,
            options,
            {
                "base_chunk": 0,  # 0: the config's chunked_prefill_size
                "min_chunk": 64,
                "max_chunk": 4096,
                "window": 256,
                "min_samples": 8,
                "smoothing": 0.5,  # weight of the new answer in the EMA
            },
        )
        if not 0 < opts["smoothing"] <= 1:
            raise ValueError("policy 'dynamic-chunking': option 'smoothing' must be in (0, 1]")
        if opts["min_chunk"] < 1 or opts["max_chunk"] < opts["min_chunk"]:
            raise ValueError("policy 'dynamic-chunking': need 1 <= min_chunk <= max_chunk")
        self.opts = opts
        self.model = LatencyModel(opts["window"], opts["min_samples"])
        self._smoothed: float | None = None

    # -- learning -------------------------------------------------------------------------
    def observe(self, plan: BatchPlan, seconds: float) -> None:
        self.model.observe(plan, seconds)

    # -- deciding -------------------------------------------------------------------------
    def base_chunk(self, ctx: PolicyContext) -> int:
        return self.opts["base_chunk"] or ctx.config.chunked_prefill_size or self.opts["max_chunk"]

    def chunk_for_prefix(self, prefix_len: int, base: int) -> int:
        """The chunk length whose fitted cost at ``prefix_len`` equals a base chunk's at 0."""
        model = self.model
        if not model.fitted:
            return base
        a, b, _, _ = model.coefficients()
        target = a * base * base + b * base
        if target <= 0 or a <= 0:
            return base  # no attention cost measured: every chunk costs the same
        return model.tokens_within(target, prefix_len)

    def budget(self, ctx: PolicyContext) -> StepBudget:
        base = self.base_chunk(ctx)
        prefix = ctx.chunked.kv_len if ctx.chunked is not None else 0
        raw = self.chunk_for_prefix(prefix, base)
        alpha = self.opts["smoothing"]
        self._smoothed = (
            raw if self._smoothed is None else alpha * raw + (1 - alpha) * self._smoothed
        )
        page = max(ctx.config.page_size, 1)
        chunk = int(min(max(self._smoothed, self.opts["min_chunk"]), self.opts["max_chunk"]))
        chunk = max(page, chunk // page * page)
        # one chunk is the step's prefill: that is what keeps every step's cost level
        return StepBudget(prefill_tokens=chunk, total_tokens=None, chunk_size=chunk)
