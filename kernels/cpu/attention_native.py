"""Paged decode and extend attention through the native CPU kernels (kernels/cpu/cpu_decode_attention.c,
cpu_extend_attention.c).

Keys and values are read in place from the pool by page (no gathered copy), work items run on
torch's OpenMP threads, scores and softmax are float32; the torch references
(``attention_ref.decode_attention`` / ``extend_attention``) are the oracles they are tested
against. The planners return None where a kernel does not apply (not a CPU tensor, another
dtype, unsupported head shapes, or no compiled kernel): callers then take the torch path.

A float16 pool (float32 queries and outputs) is read by the kernels' -DKV_F16 builds
(cpu_kv.h, ``cpu_native.kv_flags``), an int8 pool (rows with their scales: kv_int8_ref.py;
float32 or bfloat16 queries and outputs) by their -DKV_I8 builds; bfloat16 and float32 pools
by the default one, whose element is the queries' dtype.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.plan_threads import plan_threads
from asyncengine.kernels.pool_pairs import NARROW_POOLS, beside_what, pool_fits
from asyncengine.kernels.reference.kv_int8_ref import cache_head_dim

_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int8)
MAX_GROUP, MAX_HEAD_DIM = 16, 256
EXTEND_HEAD_DIMS = (64, 128, 256)  # the extend kernel's specializations (256: Gemma 2/3)
# "0": extends keep the torch path where the native kernel would run (to measure what it gives)
EXTEND_ENABLE_ENV = "ASYNCENGINE_NATIVE_EXTEND"


@dataclass(slots=True)
class NativeDecodePlan:
    block_table: torch.Tensor  # [B, P] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, contiguous
    page_size: int


@dataclass(slots=True)
class NativeExtendPlan:
    block_table: torch.Tensor  # [B, P] int32, contiguous
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    page_size: int
    num_tokens: int


_DECODE_LIB, _EXTEND_LIB = "cpu_decode_attention", "cpu_extend_attention"
_AVX512, _AVX2 = 1, 4  # asyncengine_extend_attention_features: the build's item kernels


def _extend_kernel(kv_dtype: torch.dtype = torch.float32) -> Any:
    return _bound(_EXTEND_LIB, "asyncengine_paged_extend_attention", _EXTEND_ARGS, kv_dtype)


def extend_kernel_runs(kv_dtype: torch.dtype = torch.float32) -> bool:
    """The extend kernel is built with AVX-512 or AVX2 + FMA (it has no portable path:
    elsewhere extends take the torch path)."""
    return bool(extend_kernel_features(kv_dtype) & (_AVX512 | _AVX2))


def extend_kernel_features(kv_dtype: torch.dtype = torch.float32) -> int:
    """The extend kernel build's item kernels (bits: 1 AVX-512, 2 AVX512-BF16, 4 AVX2 + FMA);
    0 without the library."""
    lib = cpu_native.load(_EXTEND_LIB, cpu_native.kv_flags(kv_dtype))
    if lib is None or _extend_kernel(kv_dtype) is None:
        return 0
    return int(lib.asyncengine_extend_attention_features())


def _queries_fit(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """A narrower pool's build takes the queries kernels/pool_pairs.py says it sits beside."""
    if k_cache.dtype in NARROW_POOLS and not pool_fits(k_cache.dtype, q.dtype):
        pool = str(k_cache.dtype).removeprefix("torch.")
        raise ValueError(
            f"a {pool} KV pool is read with {beside_what(k_cache.dtype)} queries, not {q.dtype}"
        )


def _supported(num_heads: int, k_cache: torch.Tensor) -> bool:
    num_kv_heads, head_dim = k_cache.shape[1], cache_head_dim(k_cache)
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in _DTYPES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % 32 == 0
        and head_dim <= MAX_HEAD_DIM
    )


def plan_native_extend(
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_heads: int,
    k_cache: torch.Tensor,
) -> NativeExtendPlan | None:
    if not _supported(num_heads, k_cache) or cache_head_dim(k_cache) not in EXTEND_HEAD_DIMS:
        return None
    if os.environ.get(EXTEND_ENABLE_ENV, "1") == "0" or not extend_kernel_runs(k_cache.dtype):
        return None
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    return NativeExtendPlan(
        block_table.to(torch.int32).contiguous(),
        cu,
        seq_lens.to(torch.int32).contiguous(),
        page_size,
        int(cu[-1]),
    )


def native_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: NativeExtendPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [N, H, D] ragged as planned (heads contiguous within a row) -> [N, H, D]; a query at
    position p sees keys p - window + 1 .. p (``window`` 0: all up to p), scaled scores s
    become softcap * tanh(s / softcap) (``softcap`` 0: off)."""
    kernel = _extend_kernel(k_cache.dtype)
    assert kernel is not None
    _queries_fit(q, k_cache)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens != plan.num_tokens:
        raise ValueError(f"{num_tokens} queries for an extend plan of {plan.num_tokens}")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the native extend kernel reads contiguous [S, Hkv, D] caches")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    if num_tokens == 0:
        return out
    rc = kernel(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        plan.block_table.data_ptr(),
        plan.block_table.stride(0),
        plan.cu_seqlens_q.data_ptr(),
        plan.seq_lens.data_ptr(),
        plan.seq_lens.shape[0],
        num_heads,
        k_cache.shape[1],
        head_dim,
        plan.page_size,
        scale,
        window,
        softcap,
        out.data_ptr(),
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(
            f"native extend kernel refused shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
        )
    return out


def _kernel(kv_dtype: torch.dtype = torch.float32) -> Any:
    # its split-K ranges planned for plan_threads() on a team of torch's count (plan_threads.py)
    return _bound(
        _DECODE_LIB, "asyncengine_paged_decode_attention_planned", _PLANNED_ARGS, kv_dtype
    )


def _bound(library: str, name: str, argtypes: list[Any], kv_dtype: torch.dtype) -> Any:
    """The function ``name`` of kernels/cpu/<library>.c (its build for a pool of ``kv_dtype``) with
    its ctypes signature set, or None without the library."""
    lib = cpu_native.load(library, cpu_native.kv_flags(kv_dtype))
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return fn


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# q, q row stride, k_cache, v_cache, block_table, table row stride, [cu_seqlens_q,] seq_lens,
# B, H, Hkv, D, page_size, scale, window, softcap, out, is_bf16, threads
_DECODE_ARGS = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64]
_DECODE_ARGS += [ctypes.c_float, _I64, ctypes.c_float, _PTR, ctypes.c_int, ctypes.c_int]
_EXTEND_ARGS = [*_DECODE_ARGS[:6], _PTR, *_DECODE_ARGS[6:]]
_PLANNED_ARGS = [*_DECODE_ARGS, ctypes.c_int]  # and the threads its items are planned for


def plan_native_decode(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_heads: int,
    k_cache: torch.Tensor,
) -> NativeDecodePlan | None:
    if not _supported(num_heads, k_cache) or _kernel(k_cache.dtype) is None:
        return None
    return NativeDecodePlan(
        block_table.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(), page_size
    )


def native_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: NativeDecodePlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [B, H, D] (heads contiguous within a row) -> [B, H, D]; ``window`` and ``softcap`` as in
    ``native_extend_attention`` (each query is the last position of its request)."""
    kernel = _kernel(k_cache.dtype)
    assert kernel is not None
    _queries_fit(q, k_cache)
    batch, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the native decode kernel reads contiguous [S, Hkv, D] caches")
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype)
    if batch == 0:
        return out
    rc = kernel(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        plan.block_table.data_ptr(),
        plan.block_table.stride(0),
        plan.seq_lens.data_ptr(),
        batch,
        num_heads,
        k_cache.shape[1],
        head_dim,
        plan.page_size,
        scale,
        window,
        softcap,
        out.data_ptr(),
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
        plan_threads(),
    )
    if rc != 0:
        raise ValueError(
            f"native decode kernel refused shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
        )
    return out
