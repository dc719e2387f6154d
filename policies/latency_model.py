"""LatencyModel: a step-time model fitted online to the engine's measured steps.

    step_seconds = a * sum(2*l*x + x*x) + b * sum(x) + c * decodes + d

over the step's prefill segments (``x`` tokens on top of a prefix of ``l``), by least squares
over a sliding window of observed steps (only steps that prefilled count). Dynamic chunking
solves it for equal-cost chunks; the SLO policy for the prefill that keeps a step within the
ITL target and for how long a prompt's prefill takes.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from asyncengine.common.plan import BatchPlan


class LatencyModel:
    def __init__(self, window: int = 256, min_samples: int = 8) -> None:
        self.samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.coef: np.ndarray | None = None  # a, b, c, d
        self._since_fit = 0

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        if not plan.extends:
            return
        attn = float(sum(2 * s.start_pos * s.num_tokens + s.num_tokens**2 for s in plan.extends))
        linear = float(sum(s.num_tokens for s in plan.extends))
        self.samples.append((attn, linear, float(len(plan.decodes)), seconds))
        self._since_fit += 1
        if len(self.samples) >= self.min_samples and (self.coef is None or self._since_fit >= 4):
            self.fit()

    def fit(self) -> None:
        data = np.asarray(self.samples, dtype=np.float64)
        features = np.column_stack([data[:, 0], data[:, 1], data[:, 2], np.ones(len(data))])
        scale = np.maximum(np.abs(features).max(axis=0), 1e-12)
        coef, *_ = np.linalg.lstsq(features / scale, data[:, 3], rcond=None)
        self.coef = coef / scale
        self._since_fit = 0

    @property
    def fitted(self) -> bool:
        return self.coef is not None

    def coefficients(self) -> tuple[float, float, float, float]:
        """a, b, c, d clamped at 0 (a fit over noisy steps can dip below)."""
        assert self.coef is not None
        a, b, c, d = (max(float(v), 0.0) for v in self.coef)
        return a, b, c, d

    def prefill_seconds(self, tokens: int, prefix: int = 0) -> float:
        """The prefill part of a step that computes ``tokens`` on top of ``prefix`` (0 unfitted)."""
        if self.coef is None or tokens <= 0:
            return 0.0
        a, b, _, _ = self.coefficients()
        return a * (2 * prefix * tokens + tokens * tokens) + b * tokens

    def decode_seconds(self, decodes: int) -> float:
        """A step of ``decodes`` decodes and no prefill (0 unfitted)."""
        if self.coef is None:
            return 0.0
        _, _, c, d = self.coefficients()
        return c * decodes + d

    def tokens_within(self, seconds: float, prefix: int) -> int:
        """The most prefill tokens on top of ``prefix`` whose prefill part costs ``seconds``
        (the positive root of a*x^2 + (2*a*prefix + b)*x = seconds); -1 unfitted."""
        if self.coef is None:
            return -1
        if seconds <= 0:
            return 0
        a, b, _, _ = self.coefficients()
        lin = 2 * a * prefix + b
        if a <= 0:
            return int(seconds / lin + 1e-6) if lin > 0 else -1
        # the form without cancellation: at prefix 0 and seconds = a*n*n + b*n it gives n
        # exactly, which rounding must not turn into n - 1
        return int(2 * seconds / (lin + math.sqrt(lin * lin + 4 * a * seconds)) + 1e-6)
