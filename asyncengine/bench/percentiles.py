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


_REPORTED = (50, 90, 99)  # the percentiles LatencyStats gives


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
        # only the ranks the percentiles read (and the last) need their sorted values: a
        # partition at those ranks puts each where a sort would, in linear time (a million
        # requests' pooled token gaps are ~2e8 values)
        n = int(array.size)
        ranks = {n - 1}
        for q in _REPORTED:
            index = (n - 1) * q / 100.0
            ranks.update((math.floor(index), min(math.floor(index) + 1, n - 1)))
        ordered = np.partition(array, sorted(ranks))
        p50, p90, p99 = (percentile_of_sorted(ordered, q) for q in _REPORTED)
        return cls(n, float(array.mean()), p50, p90, p99, float(ordered[-1]))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
