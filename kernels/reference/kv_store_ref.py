"""Writing new tokens' K/V into the paged pool."""

from __future__ import annotations

import torch

from asyncengine.kernels.reference.kv_int8_ref import INT8, store_kv_int8


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache/v_cache [S, Hkv, D] get k/v [N, Hkv, D] at rows slot_mapping [N] (int64), in place
    (an int8 pool's rows quantized, their scales beside them: kv_int8_ref.py)."""
    if k_cache.dtype == INT8:
        store_kv_int8(k_cache, v_cache, k, v, slot_mapping)
        return
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def copy_kv_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, copies: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """Rows ``copies[0]`` of k_cache/v_cache [S, Hkv, D] copied to rows ``copies[1]`` [C]
    (int64), in place; no row is both a source and a destination."""
    source, destination = copies
    if k_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel: copy the bytes
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)
    k_cache.index_copy_(0, destination, k_cache.index_select(0, source))
    v_cache.index_copy_(0, destination, v_cache.index_select(0, source))
