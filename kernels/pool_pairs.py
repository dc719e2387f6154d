"""Which activation dtypes a K/V pool of each element type may sit beside: what the native CPU
kernels' builds read and write (kernels/cpu/cpu_kv.h), the Triton kernels read and write, and
their torch references dequantize to. One rule for the config's check (executor/kv_dtype.py),
the runner's pool check and the kernels' bindings.

A pool of the activations' own dtype always; a float16 pool beside float32 activations (its
-DKV_F16 builds take float32 queries and rows only); an int8 pool (a scale per token and head:
kv_int8_ref.py) beside float32 or bfloat16 activations (its -DKV_I8 builds widen bfloat16 queries
and round their outputs back; the Triton kernels take either); an fp8 pool (kv_fp8_ref.py) the
same, read by the Triton kernels only (on CUDA, or on a CPU under their interpreter)."""

from __future__ import annotations

import torch

# the activation dtypes each narrower pool is read beside, besides its own dtype
NARROW_POOLS: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float16: (torch.float32,),
    torch.int8: (torch.float32, torch.bfloat16),
    torch.float8_e4m3fn: (torch.float32, torch.bfloat16),
}


def pool_fits(pool: torch.dtype, activations: torch.dtype) -> bool:
    """Whether a K/V pool of ``pool`` is read and written beside ``activations``."""
    return pool == activations or activations in NARROW_POOLS.get(pool, ())


def beside_what(pool: torch.dtype) -> str:
    """The activation dtypes a narrower ``pool`` sits beside, for messages ("float32 or
    bfloat16")."""
    names = [str(d).removeprefix("torch.") for d in NARROW_POOLS.get(pool, (pool,))]
    return " or ".join(names)
