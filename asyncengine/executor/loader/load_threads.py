"""torch at one intra-op thread while weights are read, reordered and packed.

Loading is row copies (unpermuting q/k, merging q/k/v and gate/up, packing into the arena):
memory-bound, where a second thread gains little, and where on a busy machine each small
op's OpenMP barrier waits for a descheduled thread (a 0.05 ms ``torch.cat`` measured at
25 ms with two threads, 500x). Restored after, for the steps (and their measured thread count). Native load work that splits
into large independent pieces (the weights' packing, kernels/cpu/cpu_weight_pack.c) runs on the
count torch had before (``native_load_threads``), handing pieces to threads as they come free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_outer_threads: list[int] = []  # torch's count outside each one_torch_thread in force


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    _outer_threads.append(before)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _outer_threads.pop()
        torch.set_num_threads(before)


def native_load_threads() -> int:
    """Threads for native load work: torch's count outside any ``one_torch_thread``."""
    return _outer_threads[0] if _outer_threads else torch.get_num_threads()
