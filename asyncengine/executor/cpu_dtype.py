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

# a decode-sized GEMM: big enough that the kernel path dominates, small enough for a slow path
_PROBE_SHAPE = (32, 256, 256)
_PROBE_REPEATS = 3


@functools.cache
def cpu_matmul_seconds(dtype: torch.dtype) -> float:
    """Best of a few timings of one [M, K] @ [K, N] product in ``dtype`` on the CPU."""
    m, k, n = _PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    torch.mm(a, b)  # the first call picks and primes the kernel
    best = float("inf")
    for _ in range(_PROBE_REPEATS):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def fastest_cpu_dtype() -> torch.dtype:
    """bfloat16 where this CPU and torch build run it at least as fast as float32, else float32."""
    fast = cpu_matmul_seconds(torch.bfloat16) <= cpu_matmul_seconds(torch.float32)
    return torch.bfloat16 if fast else torch.float32
