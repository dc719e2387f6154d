"""IQ4_NL, a GGUF block format without a native kernel whose values are small integers (its 16
levels: int8 values of a fixed table) times the block's fp16 scale, rewritten at load as Q8_0
blocks (the same scale, each value's integer as an int8): exact, so the native kernels and the
fused decode step take it at 34 bytes per 32 weights where dequantizing to bfloat16 would read
64. (Q5_0 and Q5_1, llama-quantize's blocks for rows whose length is not a multiple of 256, have
native kernels and stay as stored.) The rewrite is native (kernels/cpu/cpu_weight_pack.c);
without that library these tensors are dequantized as the others are.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from asyncengine.kernels.cpu import weight_pack_native

WIDENED_TYPES = frozenset({GGMLQuantizationType.IQ4_NL})


def widening_available() -> bool:
    """Whether ``as_q8_0`` runs here (the native library loaded)."""
    return weight_pack_native.available()


def as_q8_0(data: np.ndarray, tensor_type: GGMLQuantizationType, rows: int) -> np.ndarray:
    """A tensor of ``tensor_type`` blocks (``rows`` rows) as Q8_0 blocks: uint8 [rows, bytes]."""
    if tensor_type not in WIDENED_TYPES:
        raise ValueError(f"{tensor_type.name} blocks are not widened to Q8_0")
    block_bytes = GGML_QUANT_SIZES[tensor_type][1]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    widened = weight_pack_native.widen_q8_0(blocks, int(tensor_type))
    return widened.reshape(rows, -1)
