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

The engine writes them in plain pages and moves them into huge pages after it is ready
(``WeightArena(defer_huge_pages=True)``, ``huge_pages_step``: ``madvise(MADV_COLLAPSE)`` a few
MiB at a time, between steps). A fresh huge page is the costly one: in a VM that hands free
memory back to its host (virtio-balloon's free page reporting gives back whole free 2 MiB blocks,
not scattered 4 KiB ones) each is faulted in from the host, and writing a 1B model's 0.8 GB
into them takes 1.2-1.3 s, into plain pages 0.3 s (a whole load: 1.6 s against 0.6 s).

``ASYNCENGINE_HUGEPAGE_WEIGHTS=0`` keeps each weight in its own allocation (to measure). Where
huge pages are not available (another OS, THP off) the buffer is plain memory.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
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


# madvise(2)'s MADV_COLLAPSE (Linux 6.1+; the mmap module names it from Python 3.13 on)
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25 if sys.platform.startswith("linux") else None)
# Bytes moved into huge pages per ``huge_pages_step``: 4 huge pages, ~10-25 ms (a step's time)
COLLAPSE_BYTES = 4 * HUGE_PAGE


def _aligned_mapping(nbytes: int) -> tuple[torch.Tensor, mmap.mmap | None, int]:
    """A uint8 tensor of nbytes whose first byte is on a huge-page boundary, in a fresh private
    anonymous mapping (None where there is none: plain memory), and its offset there."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: plain memory
        return torch.empty(nbytes, dtype=torch.uint8), None, 0
    # private: a shared anonymous mapping is shmem, whose huge pages are another setting
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE
    return whole[offset : offset + nbytes], mapping, offset


def _advise_huge_pages(mapping: mmap.mmap | None, offset: int, nbytes: int) -> None:
    """madvise(MADV_HUGEPAGE) over [offset, offset + nbytes) of ``mapping``, where it can."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if mapping is None or advice is None:
        return
    try:
        mapping.madvise(advice, offset, _round_up(nbytes, HUGE_PAGE))
    except OSError as exc:  # THP compiled out: plain pages
        log.debug("huge pages not advised for the weights: %s", exc)


def hugepage_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes whose first byte is on a huge-page boundary, in a fresh
    anonymous mapping advised to use huge pages (where the OS has them)."""
    buffer, mapping, offset = _aligned_mapping(nbytes)
    _advise_huge_pages(mapping, offset, nbytes)
    return buffer


class WeightArena:
    """One huge-page buffer handed out front to back: each quantized projection's parts take the
    next slice as the model is built and are written there once, all together when the last
    is made (executor/cpu/weight_pack.py), so they lie in the order a decode step reads them.
    Sized from the checkpoint's 2-D weights, an upper bound (merged parts share their alignment
    padding): the pages of the slack at its end are never touched, so they take no memory.

    ``defer_huge_pages``: written in plain pages, moved into huge pages by ``huge_pages_step``
    (the engine calls it between steps once it is ready)."""

    def __init__(self, capacity: int, defer_huge_pages: bool = False) -> None:
        self.buffer, self._mapping, self._offset = _aligned_mapping(capacity)
        if not defer_huge_pages:
            _advise_huge_pages(self._mapping, self._offset, capacity)
        # bytes from the start moved into huge pages by ``huge_pages_step``; None: not deferred
        self.collapsed: int | None = 0 if defer_huge_pages and self._mapping is not None else None
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

    @property
    def huge_pages_deferred(self) -> bool:
        """Whether written bytes remain in plain pages for ``huge_pages_step`` to move."""
        return self.collapsed is not None and self.collapsed < self.used

    def huge_pages_step(self) -> bool:
        """Move the next ``COLLAPSE_BYTES`` of the written weights into huge pages (the same
        bytes at the same addresses: the kernel copies them); True while more remain. The first
        call advises huge pages over them all, so where MADV_COLLAPSE is missing (Linux before
        6.1) khugepaged moves them in the background instead."""
        if self.collapsed is None or self._mapping is None or self.collapsed >= self.used:
            return False
        if self.collapsed == 0:
            _advise_huge_pages(self._mapping, self._offset, self.used)
        end = min(self.collapsed + COLLAPSE_BYTES, _round_up(self.used, HUGE_PAGE))
        left_to_khugepaged = MADV_COLLAPSE is None
        if MADV_COLLAPSE is not None:
            try:
                start = self._offset + self.collapsed
                self._mapping.madvise(MADV_COLLAPSE, start, end - self.collapsed)
            except OSError as exc:
                left_to_khugepaged = exc.errno == errno.EINVAL  # a kernel before 6.1
                if not left_to_khugepaged:  # EAGAIN / ENOMEM: no huge page free for these now
                    log.debug("weights at %d left in plain pages: %s", self.collapsed, exc)
        if left_to_khugepaged:
            log.info("weights left to khugepaged for huge pages (no MADV_COLLAPSE here)")
            end = self.used
        self.collapsed = end
        return self.huge_pages_deferred


def arena_for(
    weights: Iterable[torch.Tensor | QuantizedTensor], defer_huge_pages: bool = False
) -> WeightArena | None:
    """An arena with room for every 2-D weight among ``weights`` (None: none, or turned off)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    capacity = sum(_round_up(w.nbytes, ALIGN) for w in weights if len(w.shape) == 2)
    return WeightArena(capacity, defer_huge_pages) if capacity else None
