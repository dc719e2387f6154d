"""KV store in Triton: write the new tokens' K and V into the paged pool at their slots.

A pool of the activations' float type takes the rows as they are (cast); an int8 or fp8 pool
takes each head's row quantized with its scale beside it (triton_kv_quant.py: the bits of
kv_int8_ref.py / kv_fp8_ref.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.reference.kv_int8_ref import cache_head_dim
from asyncengine.kernels.triton.triton_kv_quant import is_quantized, quantize, row_scale, scales
from asyncengine.kernels.triton.triton_utils import check_device, next_power_of_2

MAX_BLOCK = 2048


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    NUM_ELEMENTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a padding token (CUDA-graph batches): nothing to store.
    if slot >= 0:
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUM_ELEMENTS
        head = offs // HEAD_DIM
        dim = offs % HEAD_DIM
        k = tl.load(k_ptr + token * stride_kn + head * stride_kh + dim, mask=mask)
        v = tl.load(v_ptr + token * stride_vn + head * stride_vh + dim, mask=mask)
        tl.store(
            k_cache_ptr + slot * stride_kcs + head * stride_kch + dim,
            k.to(k_cache_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(
            v_cache_ptr + slot * stride_vcs + head * stride_vch + dim,
            v.to(v_cache_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _store_row_quantized(x_ptr, cache_ptr, scale_ptr, offs, mask):  # type: ignore[no-untyped-def]
    """One head's row quantized into the pool, its scale into the scale view."""
    pool = cache_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(x), 0), pool)
    tl.store(cache_ptr + offs, quantize(x, scale, pool), mask=mask)
    tl.store(scale_ptr, scale.to(tl.bfloat16))


@triton.jit
def _store_kv_quantized_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot is a padding token
        offs = tl.arange(0, BLOCK_D)
        mask = offs < HEAD_DIM
        _store_row_quantized(
            k_ptr + token * stride_kn + head * stride_kh,
            k_cache_ptr + slot * stride_kcs + head * stride_kch,
            k_scale_ptr + slot * stride_kss + head * stride_ksh,
            offs,
            mask,
        )
        _store_row_quantized(
            v_ptr + token * stride_vn + head * stride_vh,
            v_cache_ptr + slot * stride_vcs + head * stride_vch,
            v_scale_ptr + slot * stride_vss + head * stride_vsh,
            offs,
            mask,
        )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache/v_cache ``[S, Hkv, D]`` (int8, fp8: ``[S, Hkv, D + 2]``) get k/v ``[N, Hkv, D]`` at
    rows slot_mapping ``[N]``.

    In place. Tokens whose slot is negative are skipped (padding).
    """
    check_device(k_cache, v_cache, k, v, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for tensor in (k_cache, v_cache, k, v):
        if tensor.stride(-1) != 1:
            raise ValueError("the head dimension of k, v and the caches must be contiguous")
    if cache_head_dim(k_cache) != head_dim:
        raise ValueError(f"rows of {head_dim} do not fit a pool of rows {k_cache.shape[-1]}")
    if is_quantized(k_cache):
        k_scales, *k_scale_strides = scales(k_cache)
        v_scales, *v_scale_strides = scales(v_cache)
        _store_kv_quantized_kernel[(num_tokens, num_kv_heads)](
            k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            *k_scale_strides, *v_scale_strides,
            HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), num_warps=1,
        )  # fmt: skip
        return
    num_elements = num_kv_heads * head_dim
    block = min(next_power_of_2(num_elements), MAX_BLOCK)
    grid = (num_tokens, triton.cdiv(num_elements, block))
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        HEAD_DIM=head_dim,
        NUM_ELEMENTS=num_elements,
        BLOCK=block,
        num_warps=4,
    )
