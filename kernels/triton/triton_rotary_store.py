"""Rotary + KV store in one Triton kernel: what ``apply_rotary`` then ``store_kv`` do, in one
launch per layer instead of two, reading k once.

One program per token: its query heads are rotated in place in the fused QKV projection's
output, its key heads rotated and written with its value heads into the paged pool at the
token's slot (a negative slot, a CUDA-graph padding row, stores nothing). The rounding is the
two kernels': cos/sin rounded to qkv's dtype, products in float32, the rotated key rounded to
qkv's dtype, then to the pool's (an int8 or fp8 pool: quantized from those rows with their
scales, triton_kv_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.reference.kv_int8_ref import cache_head_dim
from asyncengine.kernels.triton.triton_kv_quant import is_quantized, quantize, row_scale, scales
from asyncengine.kernels.triton.triton_rotary import _rotate_heads
from asyncengine.kernels.triton.triton_utils import check_device, next_power_of_2


@triton.jit
def _store_halves_quantized(first, second, dst, HALF, mask, scale_dst, mask_h):  # type: ignore[no-untyped-def]
    """Heads' rows [BLOCK_HK, HALF] x 2 (masked entries 0) quantized into the pool at dst,
    their scales at scale_dst."""
    pool = dst.dtype.element_ty
    amax = tl.maximum(tl.max(tl.abs(first), 1), tl.max(tl.abs(second), 1))
    scale = row_scale(amax, pool)
    tl.store(dst, quantize(first, scale[:, None], pool), mask=mask)
    tl.store(dst + HALF, quantize(second, scale[:, None], pool), mask=mask)
    tl.store(scale_dst, scale.to(tl.bfloat16), mask=mask_h)


@triton.jit
def _rotary_store_kernel(
    qkv_ptr,
    positions_ptr,
    cache_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_qkv,
    stride_cache,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
    num_q_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    row = cache_ptr + pos * stride_cache
    qkv_type = qkv_ptr.dtype.element_ty
    cos = tl.load(row + offs_d, mask=mask_d, other=0.0).to(qkv_type).to(tl.float32)
    sin = tl.load(row + HALF + offs_d, mask=mask_d, other=0.0).to(qkv_type).to(tl.float32)
    _rotate_heads(
        qkv_ptr, stride_qkv, HEAD_DIM, token, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF
    )
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_HK)
        mask = (offs_h[:, None] < num_kv_heads) & mask_d[None, :]
        k_first = (
            qkv_ptr
            + token * stride_qkv
            + (num_q_heads + offs_h[:, None]) * HEAD_DIM
            + offs_d[None, :]
        )
        k1 = tl.load(k_first, mask=mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_first + HALF, mask=mask, other=0.0).to(tl.float32)
        out1 = (k1 * cos[None, :] - k2 * sin[None, :]).to(qkv_type)
        out2 = (k2 * cos[None, :] + k1 * sin[None, :]).to(qkv_type)
        k_dst = k_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        v_first = k_first + num_kv_heads * HEAD_DIM
        v_dst = v_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        if QUANTIZED:
            v1 = tl.load(v_first, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_first + HALF, mask=mask, other=0.0).to(tl.float32)
            _store_halves_quantized(
                out1.to(tl.float32), out2.to(tl.float32), k_dst, HALF, mask,
                k_scale_ptr + slot * stride_kss + offs_h * stride_ksh, offs_h < num_kv_heads,
            )  # fmt: skip
            _store_halves_quantized(
                v1, v2, v_dst, HALF, mask,
                v_scale_ptr + slot * stride_vss + offs_h * stride_vsh, offs_h < num_kv_heads,
            )  # fmt: skip
        else:
            cache_type = k_cache_ptr.dtype.element_ty
            tl.store(k_dst, out1.to(cache_type), mask=mask)
            tl.store(k_dst + HALF, out2.to(cache_type), mask=mask)
            v_type = v_cache_ptr.dtype.element_ty
            tl.store(v_dst, tl.load(v_first, mask=mask, other=0.0).to(v_type), mask=mask)
            tl.store(
                v_dst + HALF, tl.load(v_first + HALF, mask=mask, other=0.0).to(v_type), mask=mask
            )


def rotary_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """qkv ``[N, (H + 2 Hkv) D]`` -> q ``[N, H, D]`` rotated in place; k rotated and v stored at
    their slots of k_cache / v_cache ``[S, Hkv, D]`` (int8, fp8: ``[S, Hkv, D + 2]``; ``apply_rotary``
    then ``store_kv``; the keys in qkv are left as they were). The signature of the native CPU
    kernel's."""
    check_device(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    head_dim = cache_head_dim(k_cache)
    num_tokens = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv of {qkv.shape[1]} columns does not hold {num_heads}+2x{num_kv_heads} heads "
            f"of {head_dim}"
        )
    if cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(f"rotary cache width {cos_sin_cache.shape[1]} != head dim {head_dim}")
    for tensor in (qkv, k_cache, v_cache, cos_sin_cache):
        if tensor.stride(-1) != 1:
            raise ValueError(
                "the last dimension of qkv, the caches and cos_sin_cache must be contiguous"
            )
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return q
    half = head_dim // 2
    k_scales, *k_scale_strides = scales(k_cache)
    v_scales, *v_scale_strides = scales(v_cache)
    _rotary_store_kernel[(num_tokens,)](
        qkv,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        slot_mapping,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        *k_scale_strides,
        *v_scale_strides,
        num_heads,
        num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HQ=next_power_of_2(num_heads),
        BLOCK_HK=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(half),
        QUANTIZED=is_quantized(k_cache),
        num_warps=4,
    )
    return q
