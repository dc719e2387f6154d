"""The quantized weights of a model in one buffer backed by transparent huge pages.

A batch-1 decode step streams every weight byte once (~96 MB for SmolLM2's Q4_1 file). In 4 KiB
pages that is ~24k TLB misses a step, and the hardware prefetcher stops at every page boundary;
in 2 MiB pages it is ~50. Linux gives a process huge pages for the anonymous memory it marks
with ``madvise(MADV_HUGEPAGE)`` (the default ``madvise`` setting of
/sys/kernel/mm/transparent_hugepage/enabled), so the parts of every quantized projection are
written, in the order a step reads them, into one anonymous mapping marked so before it is
touched; each projection then holds views of it (the same bytes: results are unchanged). The
parts are written there as the model is built, straight from the file's memory map
(``WeightArena``): the arena costs no copy of its own.
It makes the fused batch-1 step ~10% cheaper (scripts/micro/bench_decode_step.py --cpu-time, with
and without ``ASYNCENGINE_HUGEPAGE_WEIGHTS=0``).

``ASYNCENGINE_HUGEPAGE_WEIGHTS=0`` keeps each weight in its own allocation (to measure). Where
huge pages are not available (another OS, THP off) the buffer is plain memory.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable

import torch

from asyncengine.kernels.cpu.weight_pack_native import PackJob
from asyncengine.kernels.quant_formats import QuantizedTensor

log = logging.getLogger("asyncengine.executor")

ENABLE_ENV = "ASYNCENGINE_HUGEPAGE_WEIGHTS"
HUGE_PAGE = 2 << 20
ALIGN = 64  # each part starts on a cache line


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def hugepage_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes whose first byte is on a huge-page boundary, in a fresh
    anonymous mapping advised to use huge pages (where the OS has them)."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: plain memory
        return torch.empty(nbytes, dtype=torch.uint8)
    # private: a shared anonymous mapping is shmem, whose huge pages are another setting
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice, offset, _round_up(nbytes, HUGE_PAGE))
        except OSError as exc:  # THP compiled out: plain pages
            log.debug("huge pages not advised for the weights: %s", exc)
    return whole[offset : offset + nbytes]


class WeightArena:
    """One huge-page buffer handed out front to back: each quantized projection's parts take the
    next slice as the model is built and are written there once, all together when the last
    is made (executor/cpu/weight_pack.py), so they lie in the order a decode step reads them. Sized from the checkpoint's 2-D
    weights, an upper bound (merged parts share their alignment padding): the pages of the slack
    at its end are never touched, so they take no memory."""

    def __init__(self, capacity: int) -> None:
        self.buffer = hugepage_buffer(capacity)
        self.used = 0
        # slices handed out, their bytes still to write (executor/cpu/weight_pack.py: all of
        # them in one native call once the model's projections are made, ``write_pending``)
        self.pending: list[PackJob] = []

    def take(self, rows: int, row_bytes: int) -> torch.Tensor:
        """The next uint8 [rows, row_bytes] slice, starting on a cache line; past the end (a
        weight made wider than the checkpoint held it) a tensor of its own."""
        nbytes = rows * row_bytes
        if self.used + nbytes > self.buffer.numel():
            return torch.empty((rows, row_bytes), dtype=torch.uint8)
        view = self.buffer[self.used : self.used + nbytes].view(rows, row_bytes)
        self.used += _round_up(nbytes, ALIGN)
        return view


def arena_for(weights: Iterable[torch.Tensor | QuantizedTensor]) -> WeightArena | None:
    """An arena with room for every 2-D weight among ``weights`` (None: none, or turned off)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    capacity = sum(_round_up(w.nbytes, ALIGN) for w in weights if len(w.shape) == 2)
    return WeightArena(capacity) if capacity else None
