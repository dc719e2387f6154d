"""The many-row int8 product of the K formats and the 32-value block formats
(kernels/cpu/cpu_quant_i8gemm.c), loaded with ctypes.

``pack(weight)`` repacks a Q4_K / Q5_K / Q6_K weight (rows of whole 256-value super-blocks) or a
Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 one (rows of whole 32-value blocks: a partial last super-block
padded with zero blocks, as Qwen2.5-0.5B's 896 and Gemma 3 1B's 1152) once into the kernel's panels
(each value its exact integer, a nibble (Q4_K) or a byte, its scales beside it: ~0.63 / 1.13 / 1.11
/ 1.25 / 1.25 / 1.375 bytes a weight (Q5_0 / Q5_1 as Q4_0 / Q4_1), against a dense bfloat16 copy's
2); ``linear`` is then ``x @ weight.T (+ bias)`` with the activations rounded to int8 per 256 values
(per 32 against the 32-value block formats), the weights exact. ``available(formats)``: this CPU's
build has a fast kernel for those formats (AVX-512 VNNI: all of them; AVX2: the K formats). ``isa``
picks the library variant as quant_native's does ("native", "avx2", "scalar"); a build without a
fast kernel for a format runs a scalar one on the same layout (the reference the tests hold the fast
ones to).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.linear_operands import linear_operands
from asyncengine.kernels.cpu.quant_native import ISA_FLAGS
from asyncengine.kernels.quant_formats import FORMATS as QUANT_FORMATS
from asyncengine.kernels.quant_formats import QuantizedTensor

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
BLOCK32_FORMATS = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"})  # rows of whole blocks of 32
FORMATS = frozenset({"Q4_K", "Q5_K", "Q6_K"}) | BLOCK32_FORMATS
# The 32-value block formats' panels hold their values as bytes, with a min per block or not:
# the panels of a family share one layout and one kernel, so rows of several (a Q5_0 q / k beside
# a Q8_0 v) make one panel set and one call.
PANEL_FAMILIES = {"Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q5_1": "Q4_1"}
SUPER_BLOCK = 256
BLOCK = 32
PANEL_COLUMNS = 16
ENABLE_ENV = "ASYNCENGINE_I8_GEMM"  # "0": never this path (to measure what it gives)


@dataclass(frozen=True, slots=True)
class I8Panels:
    """A weight repacked for the int8 product: ``data`` uint8 [panels, panel_bytes]."""

    format_code: int
    data: torch.Tensor
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


@functools.cache
def _library(isa: str = "native") -> ctypes.CDLL | None:
    lib = cpu_native.load("cpu_quant_i8gemm", ISA_FLAGS[isa])
    if lib is None:
        return None
    lib.asyncengine_i8_fast.restype = _INT
    lib.asyncengine_i8_fast.argtypes = [_INT]
    lib.asyncengine_i8_width.restype = _INT
    lib.asyncengine_i8_width.argtypes = []
    lib.asyncengine_i8_panel_bytes.restype = _I64
    lib.asyncengine_i8_panel_bytes.argtypes = [_INT, _I64]
    lib.asyncengine_i8_pack.restype = None
    lib.asyncengine_i8_pack.argtypes = [_INT, _PTR, _I64, _I64, _I64, _INT, _PTR, _INT]
    for entry in (lib.asyncengine_i8_linear, lib.asyncengine_i8_silu_linear):
        entry.restype = _INT
        entry.argtypes = [
            _INT, _PTR, _I64, _I64, _PTR, _I64, _INT, _PTR, _PTR, _I64, _INT, _INT
        ]  # fmt: skip
    return lib


def _lib(isa: str = "native") -> ctypes.CDLL:
    lib = _library(isa)
    if lib is None:
        raise RuntimeError("the native int8 product library is not available")
    return lib


def available(isa: str = "native", formats: Iterable[str] = FORMATS) -> bool:
    """Whether this build runs a fast kernel here for every one of ``formats`` (and the path is
    not turned off)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return False
    lib = _library(isa)
    return lib is not None and all(
        lib.asyncengine_i8_fast(QUANT_FORMATS[name].code) for name in formats
    )


def kernel_width(isa: str = "native") -> int:
    """The fast kernels' vector width in bits here: 512 (AVX-512 VNNI), 256 (AVX2: the K formats'
    products as vpmaddubsw and vpmaddwd), 0 (none)."""
    lib = _library(isa)
    return 0 if lib is None else int(lib.asyncengine_i8_width())


def takes(weight: QuantizedTensor) -> bool:
    """Whether ``pack`` takes this weight (the format; rows of whole super-blocks, or of whole
    blocks of 32 for ``BLOCK32_FORMATS``), whatever the CPU."""
    name = weight.format.name
    whole = BLOCK if name in BLOCK32_FORMATS else SUPER_BLOCK
    return name in FORMATS and weight.cols > 0 and weight.cols % whole == 0


def packed_bytes(weight: QuantizedTensor) -> int:
    """The bytes ``pack`` makes of this weight (``takes`` must hold)."""
    if not takes(weight):
        raise ValueError(f"the int8 product does not take {weight.format.name} x {weight.cols}")
    rows, cols = weight.shape
    return -(-rows // PANEL_COLUMNS) * int(
        _lib().asyncengine_i8_panel_bytes(weight.format.code, cols)
    )


def panel_family(weight: QuantizedTensor) -> str:
    """The format whose panels this weight's are (its own, or its family's: PANEL_FAMILIES)."""
    return PANEL_FAMILIES.get(weight.format.name, weight.format.name)


def empty_panels(weight: QuantizedTensor, rows: int | None = None) -> I8Panels:
    """Room for the weight's panels (or for ``rows`` rows of its panel family), not yet packed
    (``takes`` must hold)."""
    cols = weight.cols
    rows = weight.shape[0] if rows is None else rows
    panel_bytes = int(_lib().asyncengine_i8_panel_bytes(weight.format.code, cols))
    data = torch.empty((-(-rows // PANEL_COLUMNS), panel_bytes), dtype=torch.uint8)
    return I8Panels(weight.format.code, data, rows, cols)


def pack(weight: QuantizedTensor, out: torch.Tensor | None = None) -> I8Panels:
    """The weight (interleaved groups or rows as stored) as the int8 product's panels, written
    into ``out`` where given (the rows of a larger weight's panels, e.g. ``empty_panels``'s:
    a weight of rows from a multiple of ``PANEL_COLUMNS`` packs to its panels there)."""
    if not takes(weight):
        raise ValueError(f"the int8 product does not take {weight.format.name} x {weight.cols}")
    lib = _lib()
    rows, cols = weight.shape
    code = weight.format.code
    panel_bytes = int(lib.asyncengine_i8_panel_bytes(code, cols))
    data = weight.data if weight.data.is_contiguous() else weight.data.contiguous()
    panels = -(-rows // PANEL_COLUMNS)
    if out is None:
        out = torch.empty((panels, panel_bytes), dtype=torch.uint8)
    elif out.shape != (panels, panel_bytes) or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"the panels of {rows} x {cols} are uint8 [{panels}, {panel_bytes}]")
    lib.asyncengine_i8_pack(
        code,
        data.data_ptr(),
        data.shape[1],
        rows,
        cols,
        int(weight.interleaved),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return I8Panels(code, out, rows, cols)


def linear(
    x: torch.Tensor,
    weight: I8Panels,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    isa: str = "native",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y [n, rows] in x's dtype or ``out_dtype`` (or written into ``out``, a [n, rows] view of
    that dtype whose rows may be longer) = x @ W.T (+ bias, float32), by ``isa``'s build of the
    library. A bfloat16 x may write float32 (the LM head's logits: no bfloat16 rounding)."""
    x, out = linear_operands(x, weight.rows, weight.cols, bias, out, out_dtype)
    return _call(_lib(isa).asyncengine_i8_linear, x, weight, bias, out)


def silu_linear(
    gate_up: torch.Tensor,
    weight: I8Panels,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    isa: str = "native",
) -> torch.Tensor:
    """``linear(silu_and_mul(gate_up), ...)`` with ``gate_up`` [n, 2 * weight.cols] = gate | up:
    the same result (the activations' values are layer_ops_native.silu_and_mul's where the two
    libraries are built for one ISA) without writing the [n, weight.cols] activations out."""
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * weight.cols:
        raise ValueError(f"gate | up rows of {2 * weight.cols} values, not {tuple(gate_up.shape)}")
    x, out = linear_operands(gate_up, weight.rows, 2 * weight.cols, bias, out)
    return _call(_lib(isa).asyncengine_i8_silu_linear, x, weight, bias, out)


def _call(
    entry: Callable[..., int],
    x: torch.Tensor,
    weight: I8Panels,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    status = entry(
        weight.format_code,
        weight.data.data_ptr(),
        weight.rows,
        weight.cols,
        x.data_ptr(),
        x.shape[0],
        int(x.dtype == torch.bfloat16),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        int(out.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the int8 product could not allocate its activation buffers")
    return out
