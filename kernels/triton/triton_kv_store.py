"""KV store in Triton: write the new tokens' K and V into the paged pool at their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache/v_cache ``[S, Hkv, D]`` get k/v ``[N, Hkv, D]`` at rows slot_mapping ``[N]``.

    In place. Tokens whose slot is negative are skipped (padding).
    """
    check_device(k_cache, v_cache, k, v, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for tensor in (k_cache, v_cache, k, v):
        if tensor.stride(-1) != 1:
            raise ValueError("the head dimension of k, v and the caches must be contiguous")
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
