"""The layer's elementwise kernels through the native CPU library (kernels/cpu/cpu_layer_ops.c),
with the signatures of the torch references they are tested against (norm_ref, activation_ref,
rotary_ref + kv_store_ref). ``available()`` says whether the library loaded."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.pool_pairs import pool_fits
from asyncengine.kernels.reference.kv_int8_ref import cache_head_dim

_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    "asyncengine_rms_norm": [_PTR, _PTR, _F32, _PTR, _I64, _I64, _INT, _INT],
    "asyncengine_add_rms_norm": [_PTR, _PTR, _PTR, _F32, _PTR, _I64, _I64, _INT, _INT],
    "asyncengine_rotary_store": [
        _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _INT, _INT
    ],
    "asyncengine_silu_and_mul": [_PTR, _PTR, _I64, _I64, _INT, _INT],
}  # fmt: skip
_DTYPES = (torch.bfloat16, torch.float32)
MAX_ROW = 16384


@functools.cache
def _library(kv_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library; ``kv_flags``: its build for a float16 pool (``cpu_native.kv_flags``)."""
    lib = cpu_native.load("cpu_layer_ops", kv_flags)
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = argtypes
    return lib


def available() -> bool:
    return _library() is not None


def _lib(kv_flags: tuple[str, ...] = ()) -> Any:
    lib = _library(kv_flags)
    if lib is None:
        raise RuntimeError("the native CPU layer kernels are not available")
    return lib


def _check(x: torch.Tensor, row: int | None = None) -> int:
    """``row``: the values a kernel holds at once (default: a row of ``x``)."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES or not x.is_contiguous():
        raise ValueError(
            f"native kernels take contiguous CPU bf16/fp32 tensors, not {x.dtype} {x.device}"
        )
    row = x.shape[-1] if row is None else row
    if row > MAX_ROW:
        raise ValueError(f"rows of {row} values exceed {MAX_ROW}")
    return int(x.dtype == torch.bfloat16)


@functools.lru_cache(maxsize=1024)
def _float_weight(weight: torch.Tensor) -> torch.Tensor:
    # weights are fixed for the model's life: converted once (keyed by the tensor object)
    return weight.float().contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    bf16 = _check(x)
    h = x.shape[-1]
    y = torch.empty_like(x)
    w = _float_weight(weight)
    _lib().asyncengine_rms_norm(
        x.data_ptr(),
        w.data_ptr(),
        eps,
        y.data_ptr(),
        x.numel() // h,
        h,
        bf16,
        torch.get_num_threads(),
    )
    return y


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is written over ``residual``."""
    x = x.contiguous()
    bf16 = _check(x)
    if not residual.is_contiguous() or residual.dtype != x.dtype or residual.shape != x.shape:
        raise ValueError("the residual must be a contiguous tensor like x")
    h = x.shape[-1]
    y = torch.empty_like(x)
    w = _float_weight(weight)
    _lib().asyncengine_add_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        w.data_ptr(),
        eps,
        y.data_ptr(),
        x.numel() // h,
        h,
        bf16,
        torch.get_num_threads(),
    )
    return y, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    inter = x.shape[-1] // 2
    bf16 = _check(x, inter)  # gate and up each a row of their own (an MLP of 8960: 17,920)
    y = torch.empty((*x.shape[:-1], inter), dtype=x.dtype)
    _lib().asyncengine_silu_and_mul(
        x.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], inter, bf16, torch.get_num_threads()
    )
    return y


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
    """qkv [N, (H + 2 Hkv) D] -> q [N, H, D] rotated; k rotated and v stored at their slots of
    k_cache / v_cache [S, Hkv, D] (``apply_rotary`` then ``store_kv``, in one pass; an int8 pool's
    rows quantized from the rotated rows as rounded to qkv's dtype: kv_int8_ref.py)."""
    bf16 = _check(qkv)
    head_dim = cache_head_dim(k_cache)
    n = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim > 512:
        raise ValueError(
            f"qkv of {qkv.shape[1]} columns does not hold {num_heads}+2x{num_kv_heads} heads of {head_dim}"
        )
    if not pool_fits(k_cache.dtype, qkv.dtype) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "caches must be of qkv's dtype, float16 beside float32 qkv, or int8 (either qkv)"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    cos_sin = (
        cos_sin_cache.float().contiguous()
        if cos_sin_cache.dtype != torch.float32
        else cos_sin_cache
    )
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype)
    _lib(cpu_native.kv_flags(k_cache.dtype)).asyncengine_rotary_store(
        qkv.data_ptr(),
        qkv.stride(0),
        positions.data_ptr(),
        cos_sin.data_ptr(),
        num_heads,
        num_kv_heads,
        head_dim,
        slots.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        n,
        bf16,
        torch.get_num_threads(),
    )
    return q
