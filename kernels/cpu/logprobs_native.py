"""Per row of float32 logits: the largest, its first index and the log-sum-exp, through the
native CPU library (kernels/cpu/cpu_logprobs.c); ``row_max_lse_ref`` is the torch reference it is
tested against and the path where the library is not here."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.kernels.cpu import cpu_native

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@dataclass(slots=True)
class RowMaxLse:
    max: torch.Tensor  # [rows] float32
    argmax: torch.Tensor  # [rows] int64, the first index holding the max
    lse: torch.Tensor  # [rows] float32: log(sum(exp(logits))) of the row


@functools.cache
def _library() -> Any:
    lib = cpu_native.load("cpu_logprobs")
    if lib is None:
        return None
    fn = lib.asyncengine_row_max_lse
    fn.restype = None
    fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _INT]
    return lib


def available() -> bool:
    return _library() is not None


def row_max_lse(logits: torch.Tensor) -> RowMaxLse:
    """``logits`` [rows, vocab] float32 on the CPU (rows may be strided, values contiguous)."""
    lib = _library()
    if (
        lib is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
    ):
        return row_max_lse_ref(logits)
    rows, vocab = logits.shape
    out = RowMaxLse(
        torch.empty(rows, dtype=torch.float32),
        torch.empty(rows, dtype=torch.int64),
        torch.empty(rows, dtype=torch.float32),
    )
    lib.asyncengine_row_max_lse(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        out.max.data_ptr(),
        out.argmax.data_ptr(),
        out.lse.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def row_max_lse_ref(logits: torch.Tensor) -> RowMaxLse:
    best = torch.max(logits, dim=-1)
    return RowMaxLse(best.values, best.indices, torch.logsumexp(logits, dim=-1))
