"""The quantized matmul through the native CPU library (kernels/cpu/cpu_quant_matmul.c), with the
signatures of its torch reference (kernels/reference/quant_ref.py).

``isa`` picks the library variant: "native" (the widest path this CPU has: AVX512-VNNI, AVX2 or
scalar, decided when it is compiled for the machine), "avx2" or "scalar" (narrower paths forced,
so tests cover each ISA the CPU can run). ``available()`` says whether the library loaded.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.quant_formats import (
    F32,
    FLOAT_FORMATS,
    INTERLEAVED_FORMATS,
    QuantizedTensor,
)

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    "asyncengine_quantize_q8": [_PTR, _I64, _I64, _INT, _PTR, _PTR, _PTR, _INT],
    "asyncengine_quant_matmul": [
        _INT, _PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _INT,
        _INT
    ],
    "asyncengine_dequantize_rows": [
        _INT, _PTR, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _INT, _INT
    ],
    "asyncengine_quant_linear": [
        _INT, _PTR, _I64, _I64, _I64, _INT, _PTR, _I64, _INT, _PTR, _PTR, _I64, _INT, _INT
    ],
    "asyncengine_interleave_rows": [_INT, _PTR, _I64, _I64, _I64, _PTR],
}  # fmt: skip
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx2": ("-DQ_FORCE_AVX2",),
    "scalar": ("-DQ_FORCE_SCALAR",),
}
ACT_BLOCK = 32


@functools.cache
def _library(isa: str = "native") -> ctypes.CDLL | None:
    lib = cpu_native.load("cpu_quant_matmul", ISA_FLAGS[isa])
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = argtypes
    lib.asyncengine_quant_isa.restype = ctypes.c_char_p
    lib.asyncengine_quant_isa.argtypes = []
    return lib


def available(isa: str = "native") -> bool:
    return _library(isa) is not None


def isa_name(isa: str = "native") -> str:
    """The path the library runs: "avx512vnni", "avx2" or "scalar"."""
    return str(_lib(isa).asyncengine_quant_isa().decode())


def _lib(isa: str) -> Any:
    lib = _library(isa)
    if lib is None:
        raise RuntimeError("the native quantized matmul library is not available")
    return lib


def _check_activation(x: torch.Tensor) -> int:
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        raise ValueError(f"activations must be 2-D CPU fp32/bf16, not {x.dtype} {x.device}")
    if x.shape[1] % ACT_BLOCK:
        raise ValueError(f"rows of {x.shape[1]} values are not whole blocks of {ACT_BLOCK}")
    return int(x.dtype == torch.bfloat16)


def quantize_q8(
    x: torch.Tensor, isa: str = "native"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, k] -> (q int8 [n, k], d [n, k/32], d * sum(q) [n, k/32])."""
    x = x.contiguous()
    bf16 = _check_activation(x)
    n, k = x.shape
    q = torch.empty((n, k), dtype=torch.int8)
    d = torch.empty((n, k // ACT_BLOCK), dtype=torch.float32)
    sd = torch.empty_like(d)
    _lib(isa).asyncengine_quantize_q8(
        x.data_ptr(), n, k, bf16, q.data_ptr(), d.data_ptr(), sd.data_ptr(), torch.get_num_threads()
    )
    return q, d, sd


def matmul_quantized(
    activation: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    weight: QuantizedTensor,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    isa: str = "native",
) -> None:
    """out[:, :rows] = activation (quantize_q8's output) @ weight.T (+ bias). ``out`` may be a
    column slice of a wider row-major tensor (its row stride is honoured). Not for F32 / BF16
    weights, which read the float32 activations (``quant_linear``)."""
    if weight.format in FLOAT_FORMATS:
        raise ValueError(
            f"{weight.format.name} weights take float activations: quant_linear, not q8 blocks"
        )
    q, d, sd = activation
    n, k = q.shape
    rows, cols = weight.shape
    if cols != k:
        raise ValueError(f"activation rows of {k} values against a weight of {cols} columns")
    if (
        out.shape != (n, rows)
        or out.stride(1) != 1
        or out.dtype not in (torch.float32, torch.bfloat16)
    ):
        raise ValueError(f"out must be a row-major fp32/bf16 [{n}, {rows}] view")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("bias must be a contiguous float32 vector")
    data = weight.data
    if not data.is_contiguous():
        raise ValueError("quantized weight data must be contiguous")
    _lib(isa).asyncengine_quant_matmul(
        weight.format.code,
        data.data_ptr(),
        data.shape[1],
        rows,
        k,
        int(weight.interleaved),
        q.data_ptr(),
        d.data_ptr(),
        sd.data_ptr(),
        None,
        n,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        int(out.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )


def quant_matmul(
    x: torch.Tensor,
    weight: QuantizedTensor,
    bias: torch.Tensor | None = None,
    isa: str = "native",
) -> torch.Tensor:
    """y [n, rows] in x's dtype = x @ weight.T (+ bias), through q8 activations (F32 / BF16
    weights: through the float activations, ``quant_linear``)."""
    if weight.format in FLOAT_FORMATS:
        return quant_linear(x, weight, bias, isa)
    activation = quantize_q8(x, isa)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    matmul_quantized(activation, weight, out, bias, isa)
    return out


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedTensor,
    bias: torch.Tensor | None = None,
    isa: str = "native",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``quant_matmul`` in one native call (the q8 activations never reach Python): the batch-1
    path, where each projection's call overhead counts. F32 weights take x (float32) as it is;
    BF16 weights take float32 x as it is and bfloat16 x widened to float32 (exact), the product
    summed in float32 and rounded once to x's dtype, or written as it is where ``out_dtype`` is
    float32 (the LM head's logits)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if weight.format == F32:
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
            raise ValueError(f"F32 weights take 2-D CPU float32 activations, not {x.dtype}")
        bf16 = 0
    elif weight.format in FLOAT_FORMATS:
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
            raise ValueError(f"BF16 weights take 2-D CPU float32/bfloat16 rows, not {x.dtype}")
        bf16 = int(x.dtype == torch.bfloat16)
    else:
        bf16 = _check_activation(x)
    rows, cols = weight.shape
    n = x.shape[0]
    if cols != x.shape[1]:
        raise ValueError(
            f"activation rows of {x.shape[1]} values against a weight of {cols} columns"
        )
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("bias must be a contiguous float32 vector")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"the output is in x's dtype or float32, not {out_dtype}")
    data = weight.data
    out = torch.empty((n, rows), dtype=out_dtype or x.dtype)
    _lib(isa).asyncengine_quant_linear(
        weight.format.code,
        data.data_ptr(),
        data.shape[1],
        rows,
        cols,
        int(weight.interleaved),
        x.data_ptr(),
        n,
        bf16,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        int(out.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def dequantize_rows(
    weight: QuantizedTensor,
    rows: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
    isa: str = "native",
) -> torch.Tensor:
    """[len(rows), cols] in dtype (fp32/bf16): the given rows (None: all) dequantized."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize to float32 or bfloat16, not {dtype}")
    data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
    cols = weight.cols
    ids = rows
    if ids is not None and (ids.dtype != torch.int64 or not ids.is_contiguous()):
        ids = ids.to(torch.int64).contiguous()
    count = data.shape[0] if ids is None else ids.numel()
    if ids is not None and count:
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= data.shape[0]:
            raise IndexError(f"row ids outside 0..{data.shape[0] - 1}")
    out = torch.empty((count, cols), dtype=dtype)
    _lib(isa).asyncengine_dequantize_rows(
        weight.format.code,
        data.data_ptr(),
        data.shape[1],
        cols,
        data.shape[0],
        int(weight.interleaved),
        None if ids is None else ids.data_ptr(),
        count,
        out.data_ptr(),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def interleave(weight: QuantizedTensor, isa: str = "native") -> QuantizedTensor:
    """The weight with its rows in interleaved groups (kernels/cpu/cpu_quant_blocks.h: the batch-1
    products read 8 rows' blocks at once) where its format has that layout; else as it is.
    A new tensor of the same size (the caller drops the old one)."""
    if weight.interleaved or weight.format.name not in INTERLEAVED_FORMATS:
        return weight
    data = weight.data.contiguous()
    out = torch.empty_like(data)
    rows, row_bytes = data.shape
    _lib(isa).asyncengine_interleave_rows(
        weight.format.code, data.data_ptr(), row_bytes, rows, weight.cols, out.data_ptr()
    )
    return QuantizedTensor(weight.format, out, weight.cols, interleaved=True)
