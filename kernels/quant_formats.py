"""Quantized weight formats kept as stored (GGUF's blocks, and our per-row int8) and the tensor
that carries them: ``QuantizedTensor``, a [rows, row_bytes] uint8 tensor plus its format.

Every format here stores a weight row by row (each row is its own run of blocks), so taking,
reordering or concatenating rows is a byte-row operation: llama.cpp's q/k row permutation is
undone and q/k/v (gate/up) are fused without dequantizing anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: str
    code: int  # the format's number in kernels/cpu/cpu_quant_matmul.c
    block_size: int  # values per block
    block_bytes: int  # bytes per block
    gguf_type: int | None  # GGMLQuantizationType's value; None: ours (not a GGUF type)
    row_header_bytes: int = 0  # bytes before a row's blocks (I8's float32 scale)

    def row_bytes(self, cols: int) -> int:
        if cols % self.block_size:
            raise ValueError(
                f"{self.name} rows hold multiples of {self.block_size} values, not {cols}"
            )
        return self.row_header_bytes + cols // self.block_size * self.block_bytes


Q8_0 = QuantFormat("Q8_0", 0, 32, 34, 8)
Q4_0 = QuantFormat("Q4_0", 1, 32, 18, 2)
Q4_1 = QuantFormat("Q4_1", 2, 32, 20, 3)
Q4_K = QuantFormat("Q4_K", 3, 256, 144, 12)
Q5_K = QuantFormat("Q5_K", 4, 256, 176, 13)
Q6_K = QuantFormat("Q6_K", 5, 256, 210, 14)
Q5_0 = QuantFormat("Q5_0", 9, 32, 22, 6)
Q5_1 = QuantFormat("Q5_1", 10, 32, 24, 7)
# ours: one float32 scale per output row, then the row's int8 values (symmetric; quantization
# "int8" of a float checkpoint). The kernel reads values in blocks of 32.
I8 = QuantFormat("I8", 6, 32, 32, None, row_header_bytes=4)
# ours: a dense float32 weight as it is (4 bytes per value), so that the native products and the
# fused decode step take a float32 model's projections like any stored format (executor/layers/linear.py
# makes them; not a GGUF type here: GGUF's F32 tensors load as plain tensors)
F32 = QuantFormat("F32", 7, 1, 4, None)
# ours: a dense bfloat16 weight as it is (2 bytes per value), as F32 for a bfloat16 model (the
# kernels widen each value to float32 as they read it)
BF16 = QuantFormat("BF16", 8, 1, 2, None)

FORMATS: dict[str, QuantFormat] = {
    f.name: f for f in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, I8, F32, BF16)
}
# formats that are plain floating-point rows: they meet float32 activations, not q8 blocks
FLOAT_FORMATS = frozenset({F32, BF16})
GGUF_FORMATS: dict[int, QuantFormat] = {
    f.gguf_type: f for f in FORMATS.values() if f.gguf_type is not None
}


# GGUF block weights are kept in interleaved groups of this many rows once loaded
# (kernels/cpu/cpu_quant_blocks.h describes the layout; kernels/cpu/quant_native.interleave packs them)
INTERLEAVED_ROWS = 8
INTERLEAVED_FORMATS = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Where a grouped format's fp16 fields (the header: d; Q4_1's / Q5_1's m, the K formats'
    dmin) lie in a block as GGUF stores it; every other byte of the block is a value byte (Q5_x's
    qh, the first 4, with its bits reordered: ``high_bits_reordered``)."""

    header_at: int  # byte offset of the header in the block
    header_bytes: int
    # the first 4 value bytes (Q5_x's fifth bits, bit j: value j's) as a group holds them: byte
    # i, bit c: value 4c + i's; bit 4 + c: value 16 + 4c + i's (cpu_quant_blocks.h)
    high_bits_reordered: bool = False


GROUP_LAYOUTS: dict[str, GroupLayout] = {
    "Q8_0": GroupLayout(0, 2),
    "Q4_0": GroupLayout(0, 2),
    "Q4_1": GroupLayout(0, 4),
    "Q5_0": GroupLayout(0, 2, high_bits_reordered=True),
    "Q5_1": GroupLayout(0, 4, high_bits_reordered=True),
    "Q4_K": GroupLayout(0, 4),
    "Q5_K": GroupLayout(0, 4),
    "Q6_K": GroupLayout(208, 2),
}


@dataclass(slots=True)
class QuantizedTensor:
    """A [rows, cols] weight in ``format``: ``data`` is uint8 [rows, format.row_bytes(cols)].

    ``interleaved``: the first rows // INTERLEAVED_ROWS * INTERLEAVED_ROWS rows are stored in
    interleaved groups (the same bytes per group, permuted), the rest as GGUF stores them. Byte-row
    operations (``select_rows``, ``cat_rows``) need the rows as stored."""

    format: QuantFormat
    data: torch.Tensor
    cols: int
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"quantized data must be uint8 [rows, bytes], not {self.data.dtype}")
        if self.interleaved and self.format.name not in INTERLEAVED_FORMATS:
            raise ValueError(f"{self.format.name} has no interleaved layout")
        if self.data.shape[1] != self.format.row_bytes(self.cols):
            raise ValueError(
                f"{self.format.name} rows of {self.cols} values take "
                f"{self.format.row_bytes(self.cols)} bytes, not {self.data.shape[1]}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def select_rows(self, rows: torch.Tensor) -> QuantizedTensor:
        if self.interleaved:
            raise ValueError("rows of an interleaved weight are not byte rows")
        return QuantizedTensor(self.format, self.data.index_select(0, rows), self.cols)

    def contiguous(self) -> QuantizedTensor:
        return QuantizedTensor(self.format, self.data.contiguous(), self.cols, self.interleaved)


def f32_rows(weight: torch.Tensor) -> QuantizedTensor:
    """A float32 [rows, cols] weight as an F32 ``QuantizedTensor`` over the same bytes."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"F32 rows are a 2-D float32 weight, not {weight.dtype}")
    weight = weight.contiguous()
    return QuantizedTensor(F32, weight.view(torch.uint8), int(weight.shape[1]))


def bf16_rows(weight: torch.Tensor) -> QuantizedTensor:
    """A bfloat16 [rows, cols] weight as a BF16 ``QuantizedTensor`` over the same bytes."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"BF16 rows are a 2-D bfloat16 weight, not {weight.dtype}")
    weight = weight.contiguous()
    return QuantizedTensor(BF16, weight.view(torch.uint8), int(weight.shape[1]))


def float_rows(weight: torch.Tensor) -> QuantizedTensor:
    """A float32 or bfloat16 weight as F32 or BF16 rows over the same bytes."""
    return bf16_rows(weight) if weight.dtype == torch.bfloat16 else f32_rows(weight)


def cat_rows(parts: Sequence[torch.Tensor | QuantizedTensor]) -> torch.Tensor | QuantizedTensor:
    """Rows of every part, in order: torch.cat for dense tensors; for quantized ones of one format
    and width, their byte rows. Mixed parts (e.g. a Q4_K q_proj beside a Q6_K v_proj, as Q4_K_M
    files have) cannot share a kernel call: ValueError, and the caller keeps them apart."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))  # type: ignore[arg-type]
    first = parts[0]
    if not all(
        isinstance(p, QuantizedTensor)
        and isinstance(first, QuantizedTensor)
        and p.format == first.format
        and p.cols == first.cols
        and not p.interleaved
        for p in parts
    ):
        raise ValueError(
            "parts of different formats (or interleaved) do not fuse into one quantized weight"
        )
    assert isinstance(first, QuantizedTensor)
    datas = [p.data for p in parts if isinstance(p, QuantizedTensor)]
    return QuantizedTensor(first.format, torch.cat(datas), first.cols)
