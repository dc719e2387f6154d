"""Step-time model of the executor: a linear function of four plan features, fitted by least squares.

seconds = intercept
        + per_prefill_token * (tokens extended this step)
        + per_prefill_attention * (sum over extended tokens of the keys each one attends to)
        + per_decode_request * (decode requests)
        + per_decode_context * (sum of the decode requests' KV lengths)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from asyncengine.common.plan import BatchPlan, StepFeatures

__all__ = ["DEFAULT_COST_MODEL_PATH", "POOR_FIT_ERROR", "CostModel", "FitError", "StepFeatures"]

DEFAULT_COST_MODEL_PATH = Path(__file__).with_name("default_cost_model.json")
# a fitted model that misses its own steps by more than this (the median step, or their total)
# is reported as a poor fit: the simulator's latencies would be off by about as much
POOR_FIT_ERROR = 0.25


@dataclass(frozen=True, slots=True)
class FitError:
    """How far a cost model's step times are from the measured ones it was fitted to."""

    steps: int
    median: float  # the median step's relative error
    p90: float  # the 90th percentile step's
    predicted_seconds: float  # all steps together, as the model has them
    measured_seconds: float

    @property
    def total(self) -> float:
        """Relative error of the steps' total time (what a run's latencies add up)."""
        return abs(self.predicted_seconds - self.measured_seconds) / self.measured_seconds

    @property
    def poor(self) -> bool:
        return max(self.median, self.total) > POOR_FIT_ERROR

    def describe(self) -> str:
        ratio = self.predicted_seconds / self.measured_seconds
        return (
            f"step time error on its {self.steps} steps: median {self.median:.1%}, "
            f"p90 {self.p90:.1%}; all steps {self.predicted_seconds:.3g} s against "
            f"{self.measured_seconds:.3g} s measured ({ratio:.2f}x)"
        )


@dataclass(frozen=True, slots=True)
class CostModel:
    """Coefficients in seconds. ``description`` says where they were measured.

    The defaults are default_cost_model.json rounded: SmolLM2-135M in bfloat16 on one CPU thread.
    """

    intercept: float = 3.5e-2
    per_prefill_token: float = 8.3e-4
    per_prefill_attention: float = 1.4e-6
    per_decode_request: float = 1.1e-3
    per_decode_context: float = 5.6e-6
    description: str = "built-in (SmolLM2-135M bf16, one CPU thread, rounded)"

    def seconds(
        self,
        prefill_tokens: int,
        prefill_attention: int,
        decode_requests: int,
        decode_context: int,
    ) -> float:
        return (
            self.intercept
            + self.per_prefill_token * prefill_tokens
            + self.per_prefill_attention * prefill_attention
            + self.per_decode_request * decode_requests
            + self.per_decode_context * decode_context
        )

    def time_of(self, features: StepFeatures) -> float:
        return self.seconds(
            features.prefill_tokens,
            features.prefill_attention,
            features.decode_requests,
            features.decode_context,
        )

    def step_time(self, plan: BatchPlan) -> float:
        return self.time_of(StepFeatures.of_plan(plan))

    @property
    def coefficients(self) -> list[float]:
        return [
            self.intercept,
            self.per_prefill_token,
            self.per_prefill_attention,
            self.per_decode_request,
            self.per_decode_context,
        ]

    @classmethod
    def fit(
        cls, features: Sequence[StepFeatures], seconds: Sequence[float], description: str = ""
    ) -> CostModel:
        """Non-negative least squares on relative error (small decode steps matter as much as
        big prefills). Features that would get a negative weight are dropped and the rest refit."""
        if len(features) != len(seconds) or not features:
            raise ValueError("need one measured time per feature row, and at least one row")
        times = np.asarray(seconds, dtype=float)
        if not np.all(times > 0):
            raise ValueError("measured step times must be positive")
        design = np.asarray([f.as_row() for f in features], dtype=float) / times[:, None]
        target = np.ones_like(times)
        active = list(range(design.shape[1]))
        coefficients = np.zeros(design.shape[1])
        while active:
            solution, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
            if np.all(solution >= 0):
                coefficients[active] = solution
                break
            active.pop(int(np.argmin(solution)))
        names = [f.name for f in fields(cls) if f.name != "description"]
        return cls(**dict(zip(names, coefficients.tolist(), strict=True)), description=description)

    def relative_errors(
        self, features: Sequence[StepFeatures], seconds: Sequence[float]
    ) -> np.ndarray:
        predicted = np.asarray([self.time_of(f) for f in features])
        return np.abs(predicted - np.asarray(seconds)) / np.asarray(seconds)

    def fit_error(self, features: Sequence[StepFeatures], seconds: Sequence[float]) -> FitError:
        """How far this model is from the measured ``seconds`` of steps with ``features``."""
        errors = self.relative_errors(features, seconds)
        predicted = sum(self.time_of(f) for f in features)
        return FitError(
            len(errors),
            float(np.median(errors)),
            float(np.percentile(errors, 90)),
            predicted,
            float(sum(seconds)),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown cost model keys {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_live_trace(cls, path: str | Path, min_steps: int = 5) -> CostModel:
        """Fitted to the steps a live trace measured (``serve --record-trace``, or
        ``sim.fidelity.write_measured_trace``); ValueError with fewer than ``min_steps``."""
        features, seconds = live_trace_steps(path)
        if len(seconds) < min_steps:
            raise ValueError(f"{path} holds {len(seconds)} measured steps; too few to fit a model")
        return cls.fit(features, seconds, f"fitted to {len(seconds)} steps of {Path(path).name}")

    @classmethod
    def default(cls) -> CostModel:
        """The model fitted on the development machine when shipped, else the built-in guess."""
        if DEFAULT_COST_MODEL_PATH.exists():
            return cls.load(DEFAULT_COST_MODEL_PATH)
        return cls()


def live_trace_steps(path: str | Path) -> tuple[list[StepFeatures], list[float]]:
    """The features and measured seconds of the timed steps of a live trace."""
    from asyncengine.workloads.live_trace import load_live_trace

    steps = [s for s in load_live_trace(path).steps if s.seconds > 0]
    features = [
        StepFeatures(s.prefill_tokens, s.prefill_attention, s.decode_requests, s.decode_context)
        for s in steps
    ]
    return features, [s.seconds for s in steps]
