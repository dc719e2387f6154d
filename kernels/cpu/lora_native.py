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
from asyncengine.kernels.cpu.decode_step_lora import PreparedLora, StepLora
from asyncengine.kernels.reference.lora_ref import lora_apply_ref

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_FLOATS = (torch.float32, torch.bfloat16)


@functools.cache
def _library() -> Any:
    lib = cpu_native.load("cpu_lora")
    if lib is None:
        return None
    fn = lib.asyncengine_lora_apply
    fn.restype = _INT
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _INT, _PTR, _PTR, _INT, _I64, _I64, _I64]
    fn.argtypes += [_PTR, _I64, _PTR, _INT, _INT]
    table = lib.asyncengine_lora_apply_table
    table.restype = _INT
    table.argtypes = [_PTR, _I64, _PTR, _I64, _INT, _PTR, _I64, _I64, _I64, _I64, _INT]
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
    bt: torch.Tensor,
    slices: np.ndarray,
) -> None:
    """``y[rows] += (x[rows] @ a.T) @ bt`` in place, ``bt`` being B transposed [R, out].
    ``segments`` [k, 2] int64 (start, end) runs covering exactly ``rows`` (the kernel reads the
    runs; the reference the rows); ``slices`` [s, 4] int32, the blocks of B that are not zero."""
    lib = _library()
    if (
        lib is None
        or y.device.type != "cpu"
        or x.dtype != y.dtype
        or y.dtype not in _FLOATS
        or a.dtype not in _FLOATS
        or bt.dtype != a.dtype
        or not a.is_contiguous()
        or not bt.is_contiguous()
        or x.dim() != 2
        or y.dim() != 2
        or x.stride(1) != 1
        or y.stride(1) != 1
    ):
        lora_apply_ref(y, x, rows, a, bt.t())
        return
    in_features, out_features, rank = int(a.shape[1]), int(bt.shape[1]), int(a.shape[0])
    if int(x.shape[1]) != in_features or int(y.shape[1]) != out_features:
        raise ValueError(f"LoRA shapes: x {tuple(x.shape)}, y {tuple(y.shape)}, a/b {rank}")
    status = lib.asyncengine_lora_apply(
        y.data_ptr(),
        y.stride(0),
        x.data_ptr(),
        x.stride(0),
        int(y.dtype == torch.bfloat16),
        a.data_ptr(),
        bt.data_ptr(),
        int(a.dtype == torch.bfloat16),
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


def prepare(a: torch.Tensor, bt: torch.Tensor, slices: np.ndarray) -> PreparedLora | None:
    """The weights for ``apply_prepared``, or None where the kernel does not take them."""
    if (
        _library() is None
        or a.device.type != "cpu"
        or a.dtype not in _FLOATS
        or bt.dtype != a.dtype
        or not a.is_contiguous()
        or not bt.is_contiguous()
    ):
        return None
    bf16 = int(a.dtype == torch.bfloat16)
    args = (a.data_ptr(), bt.data_ptr(), bf16, int(a.shape[1]), int(bt.shape[1]), int(a.shape[0]))
    return PreparedLora(a, bt, slices, args, a.dtype)


def apply_prepared(
    y: torch.Tensor, x: torch.Tensor, segments: np.ndarray, weights: PreparedLora
) -> bool:
    """``lora_apply`` with prepared weights; False (nothing done) where the rows do not fit
    the kernel (then take ``lora_apply``)."""
    if (
        x.dtype != y.dtype
        or y.dtype not in _FLOATS
        or x.dim() != 2
        or y.dim() != 2
        or x.stride(1) != 1
        or y.stride(1) != 1
        or x.shape[1] != weights.args[3]
        or y.shape[1] != weights.args[4]
    ):
        return False
    status = _library().asyncengine_lora_apply(
        y.data_ptr(),
        y.stride(0),
        x.data_ptr(),
        x.stride(0),
        int(y.dtype == torch.bfloat16),
        *weights.args,
        segments.ctypes.data,
        int(segments.shape[0]),
        weights.slices.ctypes.data,
        int(weights.slices.shape[0]),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the LoRA kernel could not allocate its scratch rows")
    return True


def apply_table(
    y: torch.Tensor, x: torch.Tensor, lora: StepLora, slot: int, in_features: int
) -> bool:
    """Every adapter's rows of one projection in one call: row i of ``y`` (the step's rows)
    gets ``lora``'s update at ``slot`` (layer * TARGETS + target) of its adapter. False (nothing
    done) where the rows do not fit the kernel."""
    if (
        x.dtype != y.dtype
        or y.dtype not in _FLOATS
        or x.dim() != 2
        or y.dim() != 2
        or x.stride(1) != 1
        or y.stride(1) != 1
        or x.shape[1] != in_features
        or x.shape[0] != lora.num_rows
        or y.shape[0] != lora.num_rows
    ):
        return False
    status = _library().asyncengine_lora_apply_table(
        y.data_ptr(),
        y.stride(0),
        x.data_ptr(),
        x.stride(0),
        int(y.dtype == torch.bfloat16),
        ctypes.addressof(lora.desc),
        slot,
        lora.num_rows,
        in_features,
        int(y.shape[1]),
        torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"a LoRA update is not {in_features} -> {int(y.shape[1])} features")
    if status != 0:
        raise MemoryError("the LoRA kernel could not allocate its scratch rows")
    return True
