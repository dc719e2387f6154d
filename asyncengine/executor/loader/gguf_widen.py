"""GGUF block formats without a native kernel whose values are small integers times the block's
fp16 scale, rewritten at load as Q8_0 blocks (the same scale, each value's integer as an int8):
exact, so the native kernels and the fused decode step take them at 34 bytes per 32 weights
where dequantizing to bfloat16 would read 64.

llama-quantize writes Q5_0 (and Q8_0) in place of the K formats for rows whose length is not a
multiple of 256 (Gemma 3 1B's 1152, Qwen2.5-0.5B's 896): most of such a Q4_K_M file.
IQ4_NL's 16 levels are int8 values of a fixed table.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

BLOCK = 32  # values per block, in each of these formats and in Q8_0
Q8_0_BYTES = 2 + BLOCK
# IQ4_NL's levels (ggml's kvalues_iq4nl)
_IQ4_NL_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)


def _q5_0_values(blocks: np.ndarray) -> np.ndarray:
    """[n, 22] Q5_0 blocks (fp16 d, 32 high bits, 16 bytes of low nibbles) -> [n, 32] int8."""
    # bit j of the little-endian 32 high bits is value j's fifth bit; uint8 throughout (start-up)
    fifth = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little") << 4  # [n, 32]
    low = blocks[:, 6:22]
    fifth[:, : BLOCK // 2] |= low & 0x0F
    fifth[:, BLOCK // 2 :] |= low >> 4
    return fifth.view(np.int8) - np.int8(16)


def _iq4_nl_values(blocks: np.ndarray) -> np.ndarray:
    """[n, 18] IQ4_NL blocks (fp16 d, 16 bytes of nibbles indexing the levels) -> [n, 32] int8."""
    low = blocks[:, 2:18]
    return _IQ4_NL_LEVELS[np.concatenate([low & 0x0F, low >> 4], axis=1)]


_VALUES = {
    GGMLQuantizationType.Q5_0: (2 + 4 + BLOCK // 2, _q5_0_values),
    GGMLQuantizationType.IQ4_NL: (2 + BLOCK // 2, _iq4_nl_values),
}
WIDENED_TYPES = frozenset(_VALUES)


def as_q8_0(data: np.ndarray, tensor_type: GGMLQuantizationType, rows: int) -> np.ndarray:
    """A tensor of ``tensor_type`` blocks (``rows`` rows) as Q8_0 blocks: uint8 [rows, bytes]."""
    block_bytes, values_of = _VALUES[tensor_type]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    out = np.empty((blocks.shape[0], Q8_0_BYTES), dtype=np.uint8)
    out[:, :2] = blocks[:, :2]  # the fp16 scale, as it is
    out[:, 2:] = values_of(blocks).view(np.uint8)
    return out.reshape(rows, -1)
