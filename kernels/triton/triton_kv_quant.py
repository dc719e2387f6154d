"""Quantized K/V pools in the Triton kernels (int8, fp8 e4m3): the store kernels' quantization
and the attention kernels' view of the scales.

The layout and rounding are the torch twins' bit for bit (kernels/reference/kv_int8_ref.py,
kv_fp8_ref.py): a head's row is D values then its bfloat16 scale in the next 2 bytes; the
scale is amax / QMAX (127 for int8, 448 for e4m3) rounded up to a bfloat16, a value is x / scale
rounded half-even to the pool's type. The kernels reach the scales through a bfloat16 view of
the pool (``scales``): row element D / 2 of that view is the scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.reference.kv_int8_ref import SCALED_POOLS, cache_head_dim

# 1.5 * 2**23: adding then subtracting it rounds a float32 of magnitude < 2**22 half-even to an
# integer (the interpreter has no rint; the GPU build keeps both adds, never reassociated).
_INTEGERS = tl.constexpr(12582912.0)
# 1.5 * 2**14: the same to a multiple of 2**-9, the step of e4m3's subnormals (below 2**-6)
_E4M3_SUBNORMALS = tl.constexpr(24576.0)
_E4M3_MIN_NORMAL = tl.constexpr(0.015625)


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is a pool layer of quantized rows with their scales (int8, fp8)."""
    return cache.dtype in SCALED_POOLS


def scales(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A quantized pool layer's scales as a bfloat16 ``[S, Hkv]`` view with its two strides; a
    float layer itself with strides 0 (the kernels then never read them)."""
    if not is_quantized(cache):
        return cache, 0, 0
    view = cache.view(torch.bfloat16)[..., cache_head_dim(cache) // 2]
    return view, view.stride(0), view.stride(1)


def attention_scales(
    head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """The attention kernels' scale arguments for caches read by queries of ``head_dim``: the
    keys' and values' ``scales`` views, then their strides (ValueError where they do not fit)."""
    if cache_head_dim(k_cache) != head_dim or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"q of head dim {head_dim} does not fit caches of {k_cache.dtype} rows "
            f"{k_cache.shape[-1]} / {v_cache.dtype}"
        )
    k_scales, *k_strides = scales(k_cache)
    v_scales, *v_strides = scales(v_cache)
    return k_scales, v_scales, k_strides[0], k_strides[1], v_strides[0], v_strides[1]


@triton.jit
def load_scales(scale_ptr, slot, stride_s, head, stride_h, mask):  # type: ignore[no-untyped-def]
    """The scales of one head's rows at ``slot`` [BLOCK_N], float32 (0 where masked)."""
    scales = tl.load(scale_ptr + slot * stride_s + head * stride_h, mask=mask, other=0.0)
    return scales.to(tl.float32)


@triton.jit
def row_scale(amax, POOL: tl.constexpr):  # type: ignore[no-untyped-def]
    """amax / QMAX rounded up to a bfloat16 (returned as float32): no value passes QMAX after
    the division. Rounding up is adding 0xFFFF to the float32 bits and dropping the low 16."""
    if POOL == tl.int8:
        raw = tl.math.div_rn(amax, 127.0)
    else:
        raw = tl.math.div_rn(amax, 448.0)
    bits = raw.to(tl.uint32, bitcast=True)
    return ((bits + 0xFFFF) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(y):  # type: ignore[no-untyped-def]
    """|y| <= 448 -> the nearest e4m3 value, ties to even, as float32: the cast to fp8 is then
    exact (the interpreter's own cast mis-rounds where the rounding carries into the exponent).
    Normals keep 3 of float32's 23 mantissa bits; subnormals are multiples of 2**-9."""
    bits = y.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    kept = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & 0x7FF00000
    a = tl.abs(y)
    subnormal = ((a + _E4M3_SUBNORMALS) - _E4M3_SUBNORMALS).to(tl.uint32, bitcast=True)
    rounded = tl.where(a < _E4M3_MIN_NORMAL, subnormal, kept)
    return (rounded | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def quantize(x, scale, POOL: tl.constexpr):  # type: ignore[no-untyped-def]
    """float32 x -> x / scale rounded half-even into the pool's range, in the pool's type
    (0 where scale is 0)."""
    nonzero = scale > 0.0
    y = tl.math.div_rn(x, tl.where(nonzero, scale, 1.0))
    if POOL == tl.int8:
        rounded = tl.minimum(tl.maximum((y + _INTEGERS) - _INTEGERS, -127.0), 127.0)
    else:
        rounded = _round_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
    return tl.where(nonzero, rounded, 0.0).to(POOL)
