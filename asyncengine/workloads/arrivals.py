"""Arrival processes: when each request of a workload reaches the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

ArrivalKind = Literal["burst", "poisson", "interval"]


@dataclass(frozen=True, slots=True)
class Arrivals:
    """``burst``: all at time 0; ``poisson``: exponential gaps at ``rate`` req/s;
    ``interval``: one request every ``interval`` seconds (the first at 0)."""

    kind: ArrivalKind = "burst"
    rate: float = 0.0
    interval: float = 0.0

    def __post_init__(self) -> None:
        if self.kind == "poisson" and not self.rate > 0:
            raise ValueError(f"poisson arrivals need rate > 0, got {self.rate}")
        if self.kind == "interval" and not self.interval >= 0:
            raise ValueError(f"interval arrivals need interval >= 0, got {self.interval}")
        if self.kind not in ("burst", "poisson", "interval"):
            raise ValueError(f"unknown arrival kind {self.kind!r}")

    def times(self, n: int, seed: int = 0) -> list[float]:
        """``n`` non-decreasing arrival times in seconds, the same for the same seed."""
        if self.kind == "burst":
            return [0.0] * n
        if self.kind == "interval":
            return [i * self.interval for i in range(n)]
        gaps = np.random.default_rng(seed).exponential(1.0 / self.rate, size=n)
        gaps[0] = 0.0  # the run starts with its first request
        return np.cumsum(gaps).tolist()

    @classmethod
    def parse(cls, spec: str) -> Arrivals:
        """``burst`` | ``poisson:RATE`` | ``interval:SECONDS`` (the command-line form)."""
        kind, _, value = spec.partition(":")
        if kind == "burst" and not value:
            return cls("burst")
        if kind == "poisson" and value:
            return cls("poisson", rate=float(value))
        if kind == "interval" and value:
            return cls("interval", interval=float(value))
        raise ValueError(f"bad arrival spec {spec!r}: use burst, poisson:RATE or interval:SECONDS")


def all_at_once(n: int) -> list[float]:
    return Arrivals("burst").times(n)


def poisson(n: int, rate: float, seed: int = 0) -> list[float]:
    return Arrivals("poisson", rate=rate).times(n, seed)


def fixed_interval(n: int, interval: float) -> list[float]:
    return Arrivals("interval", interval=interval).times(n)
