"""Percentiles with numpy's default ("linear") interpolation, written out so tests can check it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np


def percentile_of_sorted(sorted_values: Sequence[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending values; NaN when there are none.

    Linear interpolation between the two closest ranks at fractional index ``(n - 1) * q / 100``
    (numpy's ``method="linear"``, Hyndman & Fan type 7).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    n = len(sorted_values)
    if n == 0:
        return math.nan
    index = (n - 1) * q / 100.0
    lower = math.floor(index)
    upper = min(lower + 1, n - 1)
    low_value = float(sorted_values[lower])
    return low_value + (index - lower) * (float(sorted_values[upper]) - low_value)


def percentiles(values: Iterable[float] | np.ndarray, qs: Sequence[float]) -> list[float]:
    ordered = np.sort(np.asarray(values if isinstance(values, np.ndarray) else list(values), float))
    return [percentile_of_sorted(ordered, q) for q in qs]


@dataclass(slots=True)
class LatencyStats:
    """Distribution of one latency, in seconds (NaN everywhere when ``count == 0``)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float] | np.ndarray) -> LatencyStats:
        array = np.asarray(values if isinstance(values, np.ndarray) else list(values), float)
        if array.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        ordered = np.sort(array)
        p50, p90, p99 = (percentile_of_sorted(ordered, q) for q in (50, 90, 99))
        return cls(int(array.size), float(array.mean()), p50, p90, p99, float(ordered[-1]))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
