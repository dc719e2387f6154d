"""The quantized weights of a model in one buffer backed by transparent huge pages.

A batch-1 decode step streams every weight byte once (~96 MB for SmolLM2's Q4_1 file). In 4 KiB
pages that is ~24k TLB misses a step, and the hardware prefetcher stops at every page boundary;
in 2 MiB pages it is ~50. Linux gives a process huge pages for the anonymous memory it marks
with ``madvise(MADV_HUGEPAGE)`` (the default ``madvise`` setting of
/sys/kernel/mm/transparent_hugepage/enabled), so the parts of every quantized projection are
copied, in the order a step reads them, into one anonymous mapping marked so before it is
touched; each projection then holds views of it (the same bytes: results are unchanged).
It makes the fused batch-1 step ~10% cheaper (scripts/micro/bench_decode_step.py --cpu-time, with
and without ``ASYNCENGINE_HUGEPAGE_WEIGHTS=0``).

``ASYNCENGINE_HUGEPAGE_WEIGHTS=0`` keeps each weight in its own allocation (to measure). Where
huge pages are not available (another OS, THP off) the buffer is plain memory and only the
copy was spent.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence

import torch

from asyncengine.executor.layers.linear import QuantizedLinear
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


def pack_quantized(linears: Sequence[QuantizedLinear]) -> torch.Tensor | None:
    """Copy the parts of linears, in the order given, into one huge-page buffer and make each
    linear's parts views of it. Returns the buffer (None: nothing packed, or turned off)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    parts = [part for linear in linears for part in linear.parts]
    if not parts:
        return None
    total = sum(_round_up(part.nbytes, ALIGN) for part in parts)
    buffer = hugepage_buffer(total)
    start = 0
    for linear in linears:
        moved: list[QuantizedTensor] = []
        for part in linear.parts:
            view = buffer[start : start + part.nbytes].view(part.data.shape)
            view.copy_(part.data)
            moved.append(QuantizedTensor(part.format, view, part.cols, part.interleaved))
            start += _round_up(part.nbytes, ALIGN)
        linear.parts = moved
    return buffer
