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

import math
from collections import deque
from typing import Any

import numpy as np

from asyncengine.plan import BatchPlan
from asyncengine.policies.base import Policy, PolicyContext, StepBudget, take_options


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
        self.samples: deque[tuple[float, float, float, float]] = deque(maxlen=opts["window"])
        self.coef: np.ndarray | None = None  # a, b, c, d
        self._since_fit = 0
        self._smoothed: float | None = None

    # -- learning -------------------------------------------------------------------------
    def observe(self, plan: BatchPlan, seconds: float) -> None:
        if not plan.extends:
            return
        attn = float(sum(2 * s.start_pos * s.num_tokens + s.num_tokens**2 for s in plan.extends))
        linear = float(sum(s.num_tokens for s in plan.extends))
        self.samples.append((attn, linear, float(len(plan.decodes)), seconds))
        self._since_fit += 1
        if len(self.samples) >= self.opts["min_samples"] and (
            self.coef is None or self._since_fit >= 4
        ):
            self.fit()

    def fit(self) -> None:
        data = np.asarray(self.samples, dtype=np.float64)
        features = np.column_stack([data[:, 0], data[:, 1], data[:, 2], np.ones(len(data))])
        scale = np.maximum(np.abs(features).max(axis=0), 1e-12)
        coef, *_ = np.linalg.lstsq(features / scale, data[:, 3], rcond=None)
        self.coef = coef / scale
        self._since_fit = 0

    # -- deciding -------------------------------------------------------------------------
    def base_chunk(self, ctx: PolicyContext) -> int:
        return self.opts["base_chunk"] or ctx.config.chunked_prefill_size or self.opts["max_chunk"]

    def chunk_for_prefix(self, prefix_len: int, base: int) -> int:
        """The chunk length whose fitted cost at ``prefix_len`` equals a base chunk's at 0."""
        if self.coef is None:
            return base
        a, b = max(float(self.coef[0]), 0.0), max(float(self.coef[1]), 0.0)
        target = a * base * base + b * base
        if target <= 0:
            return base
        if a <= 0:
            return base  # no attention cost measured: every chunk costs the same
        lin = 2 * a * prefix_len + b
        # the positive root of a*x^2 + lin*x - target, in the form without cancellation; at
        # prefix 0 it is ``base`` exactly, which rounding must not turn into base - 1 (and
        # then, page aligned, into base - page)
        return int(2 * target / (lin + math.sqrt(lin * lin + 4 * a * target)) + 1e-6)

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
