"""Large CPU tensors in transparent huge pages, asked of torch's allocator before it first runs.

The quantized weights live in a huge-page arena (executor/cpu/weight_arena.py), but the dense
copies a projection builds above its crossover (oneDNN's packed bfloat16 weights, up to 3 GB for
a 1.5B model), and every weight of a dense model, come from torch's allocator: in 4 KiB pages a
32-row decode step that streams them misses the TLB ~800k times and the hardware prefetcher
stops at every page. With ``THP_MEM_ALLOC_ENABLE=1`` torch aligns each CPU allocation of 2 MiB and
up to 2 MiB and advises it to use huge pages (``madvise(MADV_HUGEPAGE)``: honoured under the
default ``madvise`` setting of /sys/kernel/mm/transparent_hugepage/enabled). A Qwen2.5-1.5B
Q4_K_M decode step of 32 rows on the dense copies took 2-4% less CPU time on one thread
(scripts/micro/bench_decode_step.py --shape qwen2.5-1.5b --mix Q4_K_M --dtype bfloat16
--batches 32 --threads 1 --cpu-time, with THP_MEM_ALLOC_ENABLE=0 and 1). It also makes the pages those
copies get independent of when they are built: without it, whether a copy made mid-run gets huge
pages depends on the system's THP setting and how fragmented memory is by then.

torch reads the variable once, at its first CPU allocation, so ``asyncengine/__init__.py`` sets it
first thing; a process that made a tensor before importing asyncengine keeps 4 KiB pages. A
value already in the environment is kept (``THP_MEM_ALLOC_ENABLE=0``: torch's default, to
measure what this gives).
"""

from __future__ import annotations

import os

ENV = "THP_MEM_ALLOC_ENABLE"


def request() -> None:
    """Ask torch for huge pages, unless the environment already says."""
    os.environ.setdefault(ENV, "1")
