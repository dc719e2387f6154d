"""The int8 K/V pool in the Triton kernels: the store kernels' quantization and the attention
kernels' view of the scales.

The layout and rounding are kernels/reference/kv_int8_ref.py's, bit for bit: a head's row is D
int8 values then its bfloat16 scale in the next 2 bytes; the scale is amax / 127 rounded up to
a bfloat16, a value is round-half-even(x / scale). The kernels reach the scales through a
bfloat16 view of the pool (``scales``): row element D / 2 of that view is the scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.reference.kv_int8_ref import INT8, cache_head_dim

# 1.5 * 2**23: adding then subtracting it rounds a float32 of magnitude < 2**22 half-even (the
# interpreter has no rint; the GPU build keeps the two adds, which are never reassociated).
_ROUND_HALF_EVEN = tl.constexpr(12582912.0)


def is_int8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an int8 pool layer (rows of values and their scales)."""
    return cache.dtype == INT8


def scales(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """An int8 pool layer's scales as a bfloat16 ``[S, Hkv]`` view with its two strides; a
    float layer itself with strides 0 (the kernels then never read them)."""
    if not is_int8(cache):
        return cache, 0, 0
    view = cache.view(torch.bfloat16)[..., cache_head_dim(cache) // 2]
    return view, view.stride(0), view.stride(1)


@triton.jit
def row_scale(amax):  # type: ignore[no-untyped-def]
    """amax / 127 rounded up to a bfloat16 (returned as float32): no value passes 127 after
    the division. Rounding up is adding 0xFFFF to the float32 bits and dropping the low 16."""
    raw = tl.math.div_rn(amax, 127.0)
    bits = raw.to(tl.uint32, bitcast=True)
    return ((bits + 0xFFFF) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def quantize(x, scale):  # type: ignore[no-untyped-def]
    """float32 x -> round-half-even(x / scale) in [-127, 127] as float32 (0 where scale is 0)."""
    nonzero = scale > 0.0
    y = tl.math.div_rn(x, tl.where(nonzero, scale, 1.0))
    rounded = (y + _ROUND_HALF_EVEN) - _ROUND_HALF_EVEN
    return tl.where(nonzero, tl.minimum(tl.maximum(rounded, -127.0), 127.0), 0.0)
