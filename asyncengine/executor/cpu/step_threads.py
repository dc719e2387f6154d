"""How many torch threads a CPU step runs on, chosen by measuring steps: all of them, or one.

A forward of ~40 prompt rows (a scoring request of lm-eval's) is a few hundred OpenMP
parallel regions (30 layers of products, attention, SiLU), and libgomp's threads spin-wait at the
end of each. On a machine whose cores another process keeps busy, each region waits for a thread
the OS has descheduled, and one thread can then be several times faster than two, where on idle
cores two are faster (scripts/bench_neighbours.py measures both). Neither count is right everywhere and the load comes and goes, so
these steps measure themselves: per class of steps (rows within a factor of eight), a smoothed
time per row for each count. A class starts on one thread (its first step a warm-up, not
counted), tries all on its third step, then takes the faster, and tries the other again after
16 steps, twice as long after each try that changes nothing (at most 256), or at once when a
step takes twice its count's usual time per row (the load came).
Steps with prompt rows and fewer than ``CHOOSE_BELOW_ROWS`` rows choose, and so do decode-only
steps of one row (``CHOOSE_DECODE_ROWS``: one stream). That fused native step is one parallel
region but 5 barriers a layer (150 a step for SmolLM2), each as exposed to a descheduled thread
as a region's end (scripts/micro/bench_decode_step.py --threads 1 against --threads 2 beside a
busy process). A one-row step's time hardly varies from
step to step, so the counts compare fairly, and a quiet stream, where two threads win, pays a
few one-thread tries (~0.5% of its steps). Decode-only steps of several rows and large prompt
steps run on all threads while the process gets its cores: on idle cores their tries of one
thread cost the 128-request offline mix ~10% (their rows and contexts vary too much for a time
per row to compare the counts), and a long prompt's chunk loses little to the spin-waits there
and half its speed on one thread; beside other processes two spinning threads lose far more
(scripts/bench_neighbours.py). The sign is the CPU those watched steps
get on all threads: process CPU time over threads x wall time, ~0.98 on idle cores, ~0.5 beside the load
(``cpu_share``, smoothed). Below ``CONTENDED_SHARE`` every step chooses, until watched steps run
on all threads with their cores again (a class's try of all threads that wins, then its steps).
Both counts give bit-identical results, so the choice changes speed only: the products split
rows and columns across threads, never a sum, and the native sums that are split (split-K
attention's key ranges, the fused step's LoRA shrinks by input) are cut for ``most`` threads
whatever the team that runs them (kernels/cpu/plan_threads.py: the runner plans every step for
``most``). tests/executor/test_step_threads.py checks both. Deterministic mode's steps choose
too: its row-blocked products and extend attention split no sum by the thread count either
(executor/deterministic.py; tests/executor/test_deterministic_threads.py).

``ASYNCENGINE_ADAPTIVE_THREADS=0`` keeps every step on the thread count the process starts with.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

ENABLE_ENV = "ASYNCENGINE_ADAPTIVE_THREADS"
FIRST_EXPLORE_AFTER = 16  # steps of a class before the count not chosen is tried again
MOST_EXPLORE_AFTER = 256  # the longest wait between tries (doubled after each that loses)
SMOOTHING = 0.5  # weight of the newest measurement in a count's time per row
CHOOSE_BELOW_ROWS = 128  # prompt steps of fewer rows choose
CHOOSE_DECODE_ROWS = 1  # decode-only steps of at most this many rows choose; others: all threads
SLOWDOWN = 2.0  # a step this many times its count's time per row: the load changed, try the other
CONTENDED_SHARE = 0.8  # every step chooses while watched steps get less CPU than this
SHARE_SMOOTHING = 0.25  # weight of the newest all-thread step in ``cpu_share``

T = TypeVar("T")


@dataclass(slots=True)
class _Class:
    """One class of steps: what each count took, and when to try the other again."""

    seconds_per_row: dict[int, float] = field(default_factory=dict)  # threads -> smoothed
    steps: int = 0
    wait: int = FIRST_EXPLORE_AFTER
    next_try: int = 0
    trying: bool = False
    try_next: int | None = None  # a count to try at the next step (the load changed)


@dataclass(slots=True)
class StepThreads:
    """Picks between ``most`` threads and one for each step; ``record`` what a step took. Steps
    are told apart by ``kind`` (decodes only, or with prompt rows) and size class."""

    most: int
    classes: dict[tuple[bool, int], _Class] = field(default_factory=dict)
    # the CPU watched steps got on all threads: CPU seconds / (threads x wall), smoothed
    cpu_share: float = 1.0

    def chooses(self, rows: int, kind: bool) -> bool:
        """Whether a step of ``rows`` rows (``kind``: with prompt rows) has its count chosen."""
        return self.contended or not self.watches(rows, kind)

    @property
    def contended(self) -> bool:
        """Whether other processes hold the cores (then every step chooses)."""
        return self.cpu_share < CONTENDED_SHARE

    def watches(self, rows: int, kind: bool) -> bool:
        """Whether a step is one that runs on all threads on a quiet machine, its CPU share on
        all threads counted toward ``cpu_share``: decode-only steps of several rows and large
        prompt steps."""
        return rows >= CHOOSE_BELOW_ROWS if kind else rows > CHOOSE_DECODE_ROWS

    def observe_share(self, seconds: float, cpu_seconds: float) -> None:
        """A watched step ran on all threads for ``seconds`` and used ``cpu_seconds``."""
        share = cpu_seconds / (self.most * seconds) if seconds > 0 else 1.0
        self.cpu_share = _smoothed(self.cpu_share, share, SHARE_SMOOTHING)

    def pick(self, rows: int, kind: bool) -> int:
        c = self.classes.setdefault((kind, _size_class(rows)), _Class())
        c.steps += 1
        times = c.seconds_per_row
        if c.steps == 1 or 1 not in times:  # one thread first; that step a warm-up (record)
            return 1
        if self.most not in times:
            c.trying = True
            return self.most
        if c.try_next is not None:
            c.trying = True
            return c.try_next
        best = self._best(c)
        if c.steps >= c.next_try:
            c.trying = True
            return self._other(best)
        return best

    def record(self, rows: int, kind: bool, threads: int, seconds: float) -> None:
        """The first step of a class is not kept: it pays one-time costs (a product's first call
        at a shape, the first prompt's allocations) that would hold its count back."""
        c = self.classes[(kind, _size_class(rows))]
        if c.steps == 1:
            return
        per_row = seconds / max(rows, 1)
        times = c.seconds_per_row
        before = times.get(threads)
        if c.trying:
            c.trying = False
            c.try_next = None
            best_before = self._best(c) if len(times) == 2 else threads
            times[threads] = per_row  # what it takes now: its last figure is old
            # a try that changed nothing waits twice as long for the next; one that did, the least
            lost = len(times) == 2 and self._best(c) == best_before != threads
            c.wait = min(2 * c.wait, MOST_EXPLORE_AFTER) if lost else FIRST_EXPLORE_AFTER
            c.next_try = c.steps + c.wait
            return
        if before is not None and per_row > SLOWDOWN * before:
            c.try_next = self._other(threads)
        times[threads] = per_row if before is None else _smoothed(before, per_row)

    def _other(self, threads: int) -> int:
        return 1 if threads == self.most else self.most

    def _best(self, c: _Class) -> int:
        return min(c.seconds_per_row, key=lambda n: c.seconds_per_row[n])


def _smoothed(before: float, now: float, weight: float = SMOOTHING) -> float:
    return weight * now + (1 - weight) * before


def step_threads(threads: int) -> StepThreads | None:
    """The chooser for a CPU runner starting on ``threads`` threads; None where there is no
    choice to make (one thread) or it is turned off."""
    if threads <= 1 or os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    return StepThreads(threads)


def run_on_chosen_threads(
    chooser: StepThreads,
    rows: int,
    kind: bool,
    step: Callable[[], T],
    set_threads: Callable[[int], None],
    clock: Callable[[], float],
    cpu_clock: Callable[[], float],
) -> T:
    """``step()`` on the thread count the chooser picks for ``rows`` rows of ``kind``, timed by
    ``clock``, then the thread count set back to ``chooser.most``; on all threads where it does
    not choose (those are watched steps: their CPU share is measured). ``cpu_clock`` is the
    process's CPU time."""
    watched = chooser.watches(rows, kind)
    if not chooser.chooses(rows, kind):  # a watched step while the cores are the process's
        start, cpu_start = clock(), cpu_clock()
        out = step()
        chooser.observe_share(clock() - start, cpu_clock() - cpu_start)
        return out
    threads = chooser.pick(rows, kind)
    set_threads(threads)
    start, cpu_start = clock(), cpu_clock()
    try:
        out = step()
    finally:
        set_threads(chooser.most)
    seconds = clock() - start
    chooser.record(rows, kind, threads, seconds)
    if watched and threads == chooser.most:
        chooser.observe_share(seconds, cpu_clock() - cpu_start)
    return out


def _size_class(rows: int) -> int:
    """1 row, 2-15, 16-127, 128-1023, ...: a factor of 8 a class (a step's time per row is
    within ~1.3x across 16-127 rows on two threads and on one)."""
    return (max(rows, 1).bit_length() + 1) // 3
