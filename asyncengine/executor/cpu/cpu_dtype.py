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
# bfloat16 repeats stop as soon as one call is slower than float32's best several times over.
_PROBE_SHAPE = (32, 512, 512)
_PROBE_REPEATS = 5
_CLEARLY_SLOWER = 4.0


@functools.cache
def cpu_matmul_seconds(dtype: torch.dtype) -> float:
    """Best of a few timings of one [M, K] @ [K, N] product in ``dtype`` on the CPU.

    On one thread: a multi-threaded product on a busy machine waits for its slowest thread
    (seen: a 0.05 ms product taking 20 ms), which measures the load, not the kernel."""
    m, k, n = _PROBE_SHAPE
    # float32 first: a bfloat16 call past a few times its best ends the bfloat16 probe
    limit = (
        float("inf")
        if dtype == torch.float32
        else _CLEARLY_SLOWER * cpu_matmul_seconds(torch.float32)
    )
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # the first call picks and primes the kernel
        best = float("inf")
        for _ in range(_PROBE_REPEATS):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
            if best > limit:
                break
    finally:
        torch.set_num_threads(threads)
    return best


def fastest_cpu_dtype() -> torch.dtype:
    """bfloat16 where this CPU and torch build run it at least as fast as float32, else float32."""
    fast = cpu_matmul_seconds(torch.bfloat16) <= cpu_matmul_seconds(torch.float32)
    return torch.bfloat16 if fast else torch.float32
