"""Rotary position embedding in Triton, neox (rotate-half) layout, in place on q and k.

One program per token rotates every query and key head of that token with the token's row of
``cos_sin_cache`` (``[max_pos, D]``: cos in the first half, sin in the second; any RoPE
scaling is already baked into the cache). As in the reference, the cos/sin values are rounded
to q's dtype before use; the products are then taken in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.triton.triton_utils import check_device, next_power_of_2


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_n,
    stride_h,
    token,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    first = x_ptr + token * stride_n + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    row = cache_ptr + pos * stride_cache
    q_type = q_ptr.dtype.element_ty
    cos = tl.load(row + offs_d, mask=mask_d, other=0.0).to(q_type).to(tl.float32)
    sin = tl.load(row + HALF + offs_d, mask=mask_d, other=0.0).to(q_type).to(tl.float32)
    _rotate_heads(
        q_ptr, stride_qn, stride_qh, token, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr, stride_kn, stride_kh, token, num_k_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF
    )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[N, H, D]`` and k ``[N, Hkv, D]`` in place at positions ``[N]``; returns them.

    q and k may be strided views (e.g. of a fused QKV projection) as long as their last
    dimension is contiguous.
    """
    check_device(q, k, positions, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if cos_sin_cache.shape[1] != head_dim or k.shape[2] != head_dim:
        raise ValueError(
            f"rotary cache width {cos_sin_cache.shape[1]} must equal the head dim {head_dim}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("the head dimension of q, k and cos_sin_cache must be contiguous")
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        num_k_heads,
        HALF=half,
        BLOCK_HQ=next_power_of_2(num_q_heads),
        BLOCK_HK=next_power_of_2(num_k_heads),
        BLOCK_HALF=next_power_of_2(half),
        num_warps=4,
    )
    return q, k
