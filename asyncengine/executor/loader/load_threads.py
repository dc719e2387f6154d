"""torch at one intra-op thread while weights are read, reordered and packed.

Loading is row copies (unpermuting q/k, merging q/k/v and gate/up, packing into the arena):
memory-bound, where a second thread gains little, and where on a busy machine each small
op's OpenMP barrier waits for a descheduled thread (a 0.05 ms ``torch.cat`` measured at
25 ms with two threads, 500x). Restored after, for the steps (and their measured thread count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
