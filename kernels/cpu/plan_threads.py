"""The thread count the native CPU kernels plan a step's work for, apart from the team that runs it.

Split-K decode attention cuts a key range into as many pieces as the threads need, and each
piece's partial softmax is merged after: how many pieces there are changes the merge's rounding.
A CPU step may run on fewer threads than the process has (executor/cpu/step_threads.py chooses
all or one), so the kernels plan their pieces for ``plan_threads()``, the process's count while
a step runs (``planning_for``), and any team, one thread included, sums the same pieces in the
same order: the same bits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


class _Planned(threading.local):
    """Per thread (a forward thread's step must not see another runner's count): the count
    each ``planning_for`` in force fixed, innermost last."""

    def __init__(self) -> None:
        self.counts: list[int] = []


_planned = _Planned()


@contextlib.contextmanager
def planning_for(threads: int) -> Iterator[None]:
    """Plan the kernels' work for ``threads`` threads inside, whatever torch's count is."""
    _planned.counts.append(max(threads, 1))
    try:
        yield
    finally:
        _planned.counts.pop()


def plan_threads() -> int:
    """The count to plan for: the innermost ``planning_for``'s, else torch's."""
    counts = _planned.counts
    return counts[-1] if counts else torch.get_num_threads()
