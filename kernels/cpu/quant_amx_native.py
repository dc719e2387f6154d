"""The GGUF block formats' many-row product with AMX (kernels/cpu/cpu_quant_amx.c), loaded with
ctypes.

``takes(weight)`` says whether a weight can go this way here (an AMX CPU whose kernel grants the
permission; Q4_K / Q5_K / Q6_K / Q8_0 / Q4_0 / Q4_1 in interleaved groups of whole groups);
``linear`` is then ``x @ weight.T (+ bias)`` with each weight value unpacked to bfloat16 once per
call and the activations rounded to bfloat16: the sums of the dense bfloat16 product, without its
copy.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.linear_operands import linear_operands
from asyncengine.kernels.quant_formats import QuantizedTensor

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
GROUP_ROWS = 8  # cpu_quant_blocks.h XR
# the formats it takes, and the columns a weight needs in whole multiples of: a K format's
# super-block, two 32-value blocks
COLUMN_MULTIPLE = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q8_0": 64, "Q4_0": 64, "Q4_1": 64}
FORMATS = frozenset(COLUMN_MULTIPLE)
ENABLE_ENV = "ASYNCENGINE_K_AMX"  # "0": never this path (to measure what it gives)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    lib = cpu_native.load("cpu_quant_amx")
    return None if lib is None else declared(lib)


def declared(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    """``lib`` (a build of cpu_quant_amx.c) with its functions' signatures, or None where it
    cannot run the product here."""
    lib.asyncengine_k_amx_available.restype = _INT
    lib.asyncengine_k_amx_available.argtypes = []
    lib.asyncengine_k_amx_linear.restype = _INT
    lib.asyncengine_k_amx_linear.argtypes = [
        _INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT, _PTR, _PTR, _I64, _INT, _INT
    ]  # fmt: skip
    return lib if lib.asyncengine_k_amx_available() else None


def available() -> bool:
    """Whether this CPU, build and process run the AMX path (asks for AMX the first time)."""
    return _library() is not None


def takes(weight: QuantizedTensor) -> bool:
    rows, cols = weight.shape
    return (
        weight.format.name in FORMATS
        and weight.interleaved
        and rows % GROUP_ROWS == 0
        and cols % COLUMN_MULTIPLE[weight.format.name] == 0
        and available()
    )


def linear(
    x: torch.Tensor,
    weight: QuantizedTensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y [n, rows] in x's dtype or ``out_dtype`` (float32: the sums as they are, not rounded to
    bfloat16 first), or written into ``out`` (a [n, rows] view of that dtype whose rows may be
    longer) = x @ weight.T (+ bias, float32). ``takes(weight)`` must hold."""
    lib = _library()
    if lib is None or not takes(weight):
        raise ValueError(f"the AMX product does not take this {weight.format.name} weight here")
    rows, cols = weight.shape
    x, out = linear_operands(x, rows, cols, bias, out, out_dtype)
    n = x.shape[0]
    data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
    status = lib.asyncengine_k_amx_linear(
        weight.format.code,
        data.data_ptr(),
        data.shape[1],
        rows,
        cols,
        x.data_ptr(),
        n,
        int(x.dtype == torch.bfloat16),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        int(out.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the AMX product could not allocate its buffers")
    return out
