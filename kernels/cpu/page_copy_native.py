"""Runs of whole KV pages copied between two paged tensors of the same row layout, every layer,
through the native CPU library (kernels/cpu/cpu_page_copy.c); ``copy_page_runs_ref`` is the
torch path it is tested against and the one taken where the library is not here."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from asyncengine.kernels.cpu import cpu_native

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _library() -> Any:
    lib = cpu_native.load("cpu_page_copy")
    if lib is None:
        return None
    fn = lib.asyncengine_copy_page_runs
    fn.restype = None
    fn.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64]
    return lib


def available() -> bool:
    return _library() is not None


def copy_page_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """``dst[:, d : d + n] = src[:, s : s + n]`` for each run ``(s, d, n)``: ``dst`` and ``src``
    are ``[layers, pages, ...]`` CPU tensors of one dtype whose pages are contiguous."""
    lib = _library()
    page_shape = dst.shape[2:]
    if (
        lib is None
        or not runs
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or dst.dtype != src.dtype
        or src.shape[0] != dst.shape[0]
        or src.shape[2:] != page_shape
        or not _pages_contiguous(dst)
        or not _pages_contiguous(src)
    ):
        copy_page_runs_ref(dst, src, runs)
        return
    flat = torch.tensor(runs, dtype=torch.int64)
    size = dst.element_size()
    lib.asyncengine_copy_page_runs(
        dst.data_ptr(),
        src.data_ptr(),
        dst.shape[0],
        dst.stride(0) * size,
        src.stride(0) * size,
        dst.stride(1) * size,
        flat.data_ptr(),
        len(runs),
    )


def _pages_contiguous(tensor: torch.Tensor) -> bool:
    """Each page one block of bytes, pages one after another within a layer."""
    return tensor[0, 0].is_contiguous() and tensor.stride(1) == tensor[0, 0].numel()


def copy_page_runs_ref(
    dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]]
) -> None:
    for source, dest, count in runs:
        dst[:, dest : dest + count].copy_(src[:, source : source + count])
