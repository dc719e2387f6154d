"""Batched LoRA on a CPU through the native library (kernels/cpu/cpu_lora.c): for each run of
rows sharing an adapter, shrink then expand, added to the projection's output in place. The torch
reference (kernels/reference/lora_ref.py) is the path where the library is not here."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.reference.lora_ref import lora_apply_ref

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def _library() -> Any:
    lib = cpu_native.load("cpu_lora")
    if lib is None:
        return None
    fn = lib.asyncengine_lora_apply
    fn.restype = _INT
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _INT, _PTR, _PTR, _I64, _I64, _I64]
    fn.argtypes += [_PTR, _I64, _PTR, _INT, _INT]
    return lib


def available() -> bool:
    return _library() is not None


def slices_array(slices: tuple[tuple[int, int, int, int], ...]) -> np.ndarray:
    return np.ascontiguousarray(np.array(slices, dtype=np.int32).reshape(-1, 4))


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    segments: np.ndarray,
    rows: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slices: np.ndarray,
) -> None:
    """``y[rows] += (x[rows] @ a.T) @ b.T`` in place. ``segments`` [k, 2] int64 (start, end)
    runs covering exactly ``rows`` (the kernel reads the runs; the reference the rows);
    ``slices`` [s, 4] int32, the blocks of ``b`` that are not zero."""
    lib = _library()
    if (
        lib is None
        or y.device.type != "cpu"
        or x.dtype != y.dtype
        or y.dtype not in (torch.float32, torch.bfloat16)
        or a.dtype != torch.float32
        or b.dtype != torch.float32
        or x.dim() != 2
        or y.dim() != 2
        or x.stride(1) != 1
        or y.stride(1) != 1
    ):
        lora_apply_ref(y, x, rows, a, b)
        return
    in_features, out_features, rank = int(a.shape[1]), int(b.shape[0]), int(a.shape[0])
    if int(x.shape[1]) != in_features or int(y.shape[1]) != out_features:
        raise ValueError(f"LoRA shapes: x {tuple(x.shape)}, y {tuple(y.shape)}, a/b {rank}")
    status = lib.asyncengine_lora_apply(
        y.data_ptr(),
        y.stride(0),
        x.data_ptr(),
        x.stride(0),
        int(y.dtype == torch.bfloat16),
        a.data_ptr(),
        b.data_ptr(),
        in_features,
        out_features,
        rank,
        segments.ctypes.data,
        int(segments.shape[0]),
        slices.ctypes.data,
        int(slices.shape[0]),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the LoRA kernel could not allocate its scratch rows")
