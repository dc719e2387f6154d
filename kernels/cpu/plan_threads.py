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
from collections.abc import Iterator

import torch

_planned: list[int] = []  # the count each ``planning_for`` in force fixed, innermost last


@contextlib.contextmanager
def planning_for(threads: int) -> Iterator[None]:
    """Plan the kernels' work for ``threads`` threads inside, whatever torch's count is."""
    _planned.append(max(threads, 1))
    try:
        yield
    finally:
        _planned.pop()


def plan_threads() -> int:
    """The count to plan for: the innermost ``planning_for``'s, else torch's."""
    return _planned[-1] if _planned else torch.get_num_threads()
