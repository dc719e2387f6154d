"""Quantized weights packed once at load (kernels/cpu/cpu_weight_pack.c): the rows of several
parts, each possibly gathered in another order, written into one destination in the interleaved
groups the batch-1 kernels read, in parallel C threads; the same bytes as
``quant_native.interleave(cat_rows([p.select_rows(order) ...]))``, without the copies between.
And ``widen_q8_0``: GGUF blocks of small integers (IQ4_NL) as Q8_0 blocks of the same
values.

``available()`` says whether the library loaded (no C compiler: callers keep the torch path).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.quant_formats import QuantFormat

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
Q8_0_BLOCK_BYTES = 34  # fp16 scale + 32 int8 values


@dataclass(frozen=True, slots=True)
class RowSource:
    """Rows of ``data`` (uint8 [rows, row_bytes], each row contiguous): all in order, or those
    ``order`` names (int64 row ids), in that order."""

    data: torch.Tensor
    order: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.data.shape[0] if self.order is None else self.order.numel())

    def addresses(self) -> torch.Tensor:
        """int64 [rows]: the address of each row, in output order."""
        ids = torch.arange(self.data.shape[0], dtype=torch.int64)
        if self.order is not None:
            ids = self.order.to(torch.int64)
        return ids * self.data.stride(0) + self.data.data_ptr()


@dataclass(frozen=True, slots=True)
class PackJob:
    """``out`` (uint8 [rows, row_bytes], contiguous) = the sources' rows one after another, the
    first rows // 8 * 8 in interleaved groups where ``interleave`` (a format that has them)."""

    fmt: QuantFormat
    sources: tuple[RowSource, ...]
    cols: int
    out: torch.Tensor
    interleave: bool


class _Job(ctypes.Structure):
    _fields_ = [
        ("fmt", ctypes.c_int32),
        ("interleave", ctypes.c_int32),
        ("n", _I64),
        ("row_bytes", _I64),
        ("k", _I64),
        ("rows", _PTR),
        ("dst", _PTR),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_native.load("cpu_weight_pack")
    if lib is None:
        return None
    lib.asyncengine_pack_jobs.restype = None
    lib.asyncengine_pack_jobs.argtypes = [_PTR, _I64, _INT]
    lib.asyncengine_widen_q8_0.restype = _INT
    lib.asyncengine_widen_q8_0.argtypes = [ctypes.c_int32, _PTR, _I64, _I64, _PTR]
    return lib


def available() -> bool:
    return _library() is not None


def _checked_addresses(job: PackJob) -> torch.Tensor:
    """The job's row addresses (int64), once its shapes are checked."""
    fmt, cols = job.fmt, job.cols
    row_bytes = fmt.row_bytes(cols)
    for source in job.sources:
        data = source.data
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes:
            raise ValueError(f"{fmt.name} rows of {cols} values are uint8 [rows, {row_bytes}]")
        if data.stride(1) != 1:
            raise ValueError("each source row must be contiguous")
        if source.order is not None and source.order.numel():
            low, high = (int(v) for v in torch.aminmax(source.order))
            if low < 0 or high >= data.shape[0]:
                raise IndexError(f"row ids outside 0..{data.shape[0] - 1}")
    rows = sum(source.rows for source in job.sources)
    out = job.out
    if out.dtype != torch.uint8 or tuple(out.shape) != (rows, row_bytes) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 [{rows}, {row_bytes}] tensor")
    if not job.sources:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([source.addresses() for source in job.sources])


def pack_many(jobs: Sequence[PackJob], threads: int) -> None:
    """Every job, in one native call (one parallel region on ``threads`` threads)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native weight-packing library is not available")
    addresses = [_checked_addresses(job) for job in jobs]  # alive until the call returns
    table = (_Job * len(jobs))()
    for entry, job, rows in zip(table, jobs, addresses, strict=True):
        entry.fmt, entry.interleave = job.fmt.code, int(job.interleave)
        entry.n, entry.row_bytes, entry.k = rows.numel(), job.fmt.row_bytes(job.cols), job.cols
        entry.rows, entry.dst = rows.data_ptr(), job.out.data_ptr()
    if jobs:
        lib.asyncengine_pack_jobs(ctypes.addressof(table), len(jobs), max(1, threads))


def pack_rows(
    fmt: QuantFormat,
    sources: Sequence[RowSource],
    cols: int,
    out: torch.Tensor,
    interleave: bool,
    threads: int,
) -> None:
    """One ``PackJob``, done now."""
    pack_many([PackJob(fmt, tuple(sources), cols, out, interleave)], threads)


def widen_q8_0(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """``blocks`` (uint8 [n, block bytes], contiguous) of GGUF type ``ggml_type`` (IQ4_NL) as
    uint8 [n, 34] Q8_0 blocks of exactly their values (without the GIL)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native weight-packing library is not available")
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or not blocks.flags.c_contiguous:
        raise ValueError("blocks must be a contiguous uint8 [blocks, block bytes] array")
    n, block_bytes = blocks.shape
    out = np.empty((n, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    if not lib.asyncengine_widen_q8_0(
        ggml_type, blocks.ctypes.data, n, block_bytes, out.ctypes.data
    ):
        raise ValueError(f"no Q8_0 widening of GGUF type {ggml_type} in blocks of {block_bytes} B")
    return out
