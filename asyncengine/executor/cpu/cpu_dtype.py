"""Which floating-point dtype runs matmuls fastest on this CPU: bfloat16 or float32.

CPUs differ by two orders of magnitude here. With AVX-512 BF16 or AMX, oneDNN runs bfloat16
matmuls ~4x faster than float32; on a CPU with AVX2 only, torch falls back to a scalar path and
bfloat16 runs ~90x *slower* (measured on an AVX2 AMD EPYC: 1.2 GFLOP/s against 111 GFLOP/s).
Instruction flags do not tell which path a given torch build takes, so ``dtype = "auto"`` asks
the build itself: one small timed GEMM per dtype, once per process (a few milliseconds).
"""

from __future__ import annotations

import functools
import time

import torch

# a decode-sized GEMM: big enough that the kernel path dominates, small enough for a slow path.
# At 32 x 256 x 256 bfloat16 led too narrowly on an AVX-512 BF16 CPU for a loaded machine to
# pick it reliably; at 32 x 512 x 512 it leads by ~1.9x. On an AVX2 CPU's slow bfloat16 path the
# bfloat16 calls stop once their best is several times float32's.
_PROBE_SHAPE = (32, 512, 512)
# The two dtypes' calls alternate, best of this many each: timed one dtype after the other, five
# calls each, a 2-core machine at load 5 had all five bfloat16 calls descheduled and picked
# float32 on an AMX CPU (whose dense weight copies are then twice the bytes and 4x slower).
_PROBE_REPEATS = 15
_CLEARLY_SLOWER = 4.0


@functools.cache
def _probe() -> dict[torch.dtype, float]:
    """Best of ``_PROBE_REPEATS`` timings of one [M, K] @ [K, N] product per dtype, the dtypes'
    calls alternating so that a busy spell slows both alike.

    On one thread: a multi-threaded product on a busy machine waits for its slowest thread
    (seen: a 0.05 ms product taking 20 ms), which measures the load, not the kernel."""
    m, k, n = _PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16)
    operands = {}
    for dtype in dtypes:
        a = torch.randn(m, k, generator=generator).to(dtype)
        operands[dtype] = (a, torch.randn(k, n, generator=generator).to(dtype))
    best = dict.fromkeys(dtypes, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in dtypes:
            torch.mm(*operands[dtype])  # the first call picks and primes the kernel
        for repeat in range(_PROBE_REPEATS):
            for dtype in dtypes:
                slow = best[torch.bfloat16] > _CLEARLY_SLOWER * best[torch.float32]
                if dtype == torch.bfloat16 and repeat >= 2 and slow:
                    continue  # a slow path (~90x): its few calls tell already
                start = time.perf_counter()
                torch.mm(*operands[dtype])
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best


def cpu_matmul_seconds(dtype: torch.dtype) -> float:
    """The probe's best time of its product in ``dtype`` (float32 or bfloat16) on the CPU."""
    return _probe()[dtype]


def fastest_cpu_dtype() -> torch.dtype:
    """bfloat16 where this CPU and torch build run it at least as fast as float32, else float32."""
    fast = cpu_matmul_seconds(torch.bfloat16) <= cpu_matmul_seconds(torch.float32)
    return torch.bfloat16 if fast else torch.float32
