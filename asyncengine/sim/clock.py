"""VirtualClock: simulated seconds, advanced only by whoever drives the run."""

from __future__ import annotations


class VirtualClock:
    """Seconds since the run started; call it to read the time (a ``clock`` for the core)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the clock cannot go back ({seconds} s)")
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)
