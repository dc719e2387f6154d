"""The torch reference of the quantized matmul (kernels/cpu/cpu_quant_matmul.c), for tests and for
machines without the native library.

    q, d, sd = quantize_q8(x)            # x [n, k] -> int8 blocks of 32, scale, scale * sum
    y = quant_matmul(x, weight, bias)    # x's q8 blocks (dequantized) @ weight (dequantized).T

``dequantize`` takes the GGUF formats through the ``gguf`` package's own dequantizers (an
implementation independent of ours) and I8 directly. The native kernel computes the same sums
as ``quant_matmul`` in a different order (float32 per block), so tests compare within float32
rounding; activation quantization is the same arithmetic bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncengine.kernels.quant_formats import (
    BF16,
    F32,
    FLOAT_FORMATS,
    GROUP_LAYOUTS,
    I8,
    INTERLEAVED_ROWS,
    QuantizedTensor,
)

ACT_BLOCK = 32


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, k] (k a multiple of 32) -> q int8 [n, k], d [n, k/32], d * sum(q) [n, k/32]:
    d = max|x| / 127 per block, q = round-half-even(x * 127 / max|x|), as the C kernel does."""
    n, k = x.shape
    blocks = x.float().reshape(n, k // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int8)
    sd = d * q.sum(dim=-1, dtype=torch.int32).float()
    return q.reshape(n, k), d, sd


def deinterleave(weight: QuantizedTensor) -> QuantizedTensor:
    """An interleaved weight's rows as GGUF stores them (the layout of cpu_quant_blocks.h, taken
    apart with tensor views: a group's block holds the 8 rows' fp16 header fields, then pieces of
    4 value bytes per row)."""
    if not weight.interleaved:
        return weight
    fmt, data = weight.format, weight.data
    rows, row_bytes = data.shape
    g = INTERLEAVED_ROWS
    grouped = rows // g * g
    nb = weight.cols // fmt.block_size
    layout = GROUP_LAYOUTS[fmt.name]
    header = layout.header_bytes
    values = fmt.block_bytes - header
    blocks = data[:grouped].reshape(grouped // g, nb, g * fmt.block_bytes)
    head = blocks[:, :, : g * header].reshape(-1, nb, header // 2, g, 2).permute(0, 3, 1, 2, 4)
    vals = blocks[:, :, g * header :].reshape(-1, nb, values // 4, g, 4).permute(0, 3, 1, 2, 4)
    head_rows, val_rows = head.reshape(-1, g, nb, header), vals.reshape(-1, g, nb, values)
    if layout.high_bits_reordered:
        val_rows = torch.cat([_high_bits_as_stored(val_rows[..., :4]), val_rows[..., 4:]], dim=-1)
    at = layout.header_at
    parts = [val_rows[..., :at], head_rows, val_rows[..., at:]]
    rows_data = torch.cat(parts, dim=3).reshape(grouped, row_bytes)
    return QuantizedTensor(fmt, torch.cat([rows_data, data[grouped:]]), weight.cols)


def _high_bits_as_stored(qh: torch.Tensor) -> torch.Tensor:
    """Q5_x fifth bits [..., 4] (uint8) as a group holds them -> as GGUF stores them (bit j of
    the 4 bytes: value j's). The group's byte i, bit c holds value 4c + i's, bit 4 + c value
    16 + 4c + i's."""
    bits = (qh.unsqueeze(-1).to(torch.int32) >> torch.arange(8, dtype=torch.int32)) & 1
    bits = bits.reshape(*qh.shape[:-1], 32)
    value_of_bit = [
        (16 if c >= 4 else 0) + 4 * (c % 4) + i for i in range(4) for c in range(8)
    ]  # group bit 8i + c
    stored = torch.zeros_like(bits)
    stored[..., value_of_bit] = bits
    weights = 1 << torch.arange(8, dtype=torch.int32)
    return (stored.reshape(*qh.shape[:-1], 4, 8) * weights).sum(-1).to(torch.uint8)


def dequantize(weight: QuantizedTensor) -> torch.Tensor:
    """The float32 [rows, cols] values the blocks stand for."""
    weight = deinterleave(weight)
    rows, cols = weight.shape
    if weight.format == F32:
        return weight.data.contiguous().view(torch.float32).clone()
    if weight.format == BF16:
        return weight.data.contiguous().view(torch.bfloat16).float()
    if weight.format == I8:
        raw = weight.data
        scale = raw[:, :4].contiguous().view(torch.float32)
        values = raw[:, 4:].contiguous().view(torch.int8).float()
        return values * scale
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    assert weight.format.gguf_type is not None
    array = gguf_dequantize(weight.data.numpy(), GGMLQuantizationType(weight.format.gguf_type))
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(rows, cols)


def quantize_i8(weight: torch.Tensor) -> QuantizedTensor:
    """A float [rows, cols] weight as I8: per row, symmetric, scale = max|w| / 127."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(w * inv).clamp(-127, 127).to(torch.int8)
    data = torch.cat([scale.contiguous().view(torch.uint8), q.view(torch.uint8)], dim=1)
    return QuantizedTensor(I8, data.contiguous(), int(weight.shape[1]))


def quant_matmul(
    x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y [n, rows] float32: x quantized to q8 blocks, times the dequantized weight (float64 sums);
    F32 / BF16 weights meet x itself (no q8 blocks)."""
    if weight.format in FLOAT_FORMATS:
        y = x.double() @ dequantize(weight).double().T
        return (y if bias is None else y + bias.double()).float()
    q, d, _ = quantize_q8(x)
    n, k = q.shape
    xq = (q.double().reshape(n, k // ACT_BLOCK, ACT_BLOCK) * d.double().unsqueeze(-1)).reshape(n, k)
    y = xq @ dequantize(weight).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()
