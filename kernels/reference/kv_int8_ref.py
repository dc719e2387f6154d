"""An int8 K/V pool in torch: the rows the native kernels' -DKV_I8 builds write and read
(kernels/cpu/cpu_kv.h), bit for bit.

A head's row of D values is stored as D int8 followed by its scale, a bfloat16 in 2 bytes
(``SCALE_BYTES``): a pool layer is int8 [S, Hkv, D + 2]. The scale is amax / 127 rounded up
to a bfloat16 (so no value passes 127 after division) and a value is round-half-even(x /
scale), so x = int8 * scale within half a step. Symmetric, no zero point: 2 more bytes a row
would leave a head of 64 below 1.9x the tokens of bfloat16 in the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
INT8 = torch.int8
# pools of one-byte values whose rows carry their scale so: int8, and fp8 e4m3 (kv_fp8_ref.py)
SCALED_POOLS = (INT8, torch.float8_e4m3fn)


def pool_row(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one head's row in a pool of ``dtype`` (int8, fp8: the values and their
    scale)."""
    return head_dim + SCALE_BYTES if dtype in SCALED_POOLS else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head dim of a pool layer [S, Hkv, row] (an int8 or fp8 row carries its scale too)."""
    row = cache.shape[-1]
    return row - SCALE_BYTES if cache.dtype in SCALED_POOLS else row


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """x >= 0 float32 -> the least bfloat16 not below it (as float32)."""
    rounded = x.to(torch.bfloat16)
    low = rounded.to(torch.float32) < x
    bits = rounded.view(torch.int16) + low.to(torch.int16)
    return bits.view(torch.bfloat16).to(torch.float32)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> int8 [..., D + 2]: the values, then their bfloat16 scale's bytes."""
    x = x.to(torch.float32)
    scale = _round_up_bf16(x.abs().amax(dim=-1, keepdim=True) / 127.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, torch.round(x / safe), torch.zeros_like(x)).clamp_(-127, 127)
    scale_bytes = scale.to(torch.bfloat16).view(torch.int8)
    return torch.cat([q.to(INT8), scale_bytes], dim=-1)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """int8 (or fp8) [..., D + 2] -> their scales, float32 [..., 1]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).to(torch.float32)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 (or fp8) [..., D + 2] -> [..., D] in ``dtype``."""
    values = rows[..., :-SCALE_BYTES].to(torch.float32) * row_scales(rows)
    return values.to(dtype)


def dequantize_flat(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Gathered token rows int8 [..., Hkv * (D + 2)] -> [..., Hkv * D] in ``dtype``."""
    heads = rows.view(*rows.shape[:-1], -1, head_dim + SCALE_BYTES)
    return dequantize_kv(heads, dtype).flatten(-2)


def store_kv_int8(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """int8 caches [S, Hkv, D + 2] get k / v [N, Hkv, D] quantized at rows slot_mapping [N]."""
    k_cache.index_copy_(0, slot_mapping, quantize_kv(k))
    v_cache.index_copy_(0, slot_mapping, quantize_kv(v))


def quantize_query(q: torch.Tensor) -> torch.Tensor:
    """[..., D] float32 queries -> the float32 values the AVX-512 VNNI int8 decode attention
    computes with (kernels/cpu/cpu_stream_i8_dots.h): each head rounded half-even to int8 at
    amax / 127 (no bfloat16 rounding of that scale), then scaled back."""
    q = q.to(torch.float32)
    scale = q.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    rounded = torch.where(scale > 0, torch.round(q / safe), torch.zeros_like(q)).clamp_(-127, 127)
    return rounded * scale
