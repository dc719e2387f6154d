"""Q5_0 and IQ4_NL blocks (llama-quantize's fallback for rows not a multiple of 256, and a
non-linear 4-bit format) are kept as Q8_0 blocks of exactly their values
(asyncengine/executor/loader/gguf_widen.py), not dequantized to the model's dtype."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from asyncengine.executor.loader import read_gguf
from asyncengine.executor.loader.gguf_widen import as_q8_0
from asyncengine.kernels.quant_formats import GGUF_FORMATS, Q8_0, QuantizedTensor
from tests.executor.test_gguf_shapes import make_hf, write_gguf


def _random_blocks(tensor_type: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """Every bit pattern of the value bytes, beside finite fp16 scales of either sign."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    rng = np.random.default_rng(int(tensor_type))
    blocks = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    scales = rng.normal(0, 0.05, blocks.shape[0]).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("tensor_type", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.IQ4_NL])
def test_widened_blocks_hold_exactly_the_values_of_the_blocks_read(
    tensor_type: GGMLQuantizationType,
) -> None:
    rows, cols = 6, 96
    blocks = _random_blocks(tensor_type, rows, cols)
    widened = as_q8_0(blocks, tensor_type, rows)
    assert widened.shape == (rows, Q8_0.row_bytes(cols))
    got = dequantize(widened, GGMLQuantizationType.Q8_0)
    want = dequantize(blocks, tensor_type)
    np.testing.assert_array_equal(got, want)


def test_q5_0_projections_are_kept_as_q8_0_blocks_of_their_values(tmp_path: Path) -> None:
    name = "llama3_rope_gqa8_untied"  # its q/k rows unpermuted as blocks too
    path = tmp_path / "q5_0.gguf"
    write_gguf(name, make_hf(name, tmp_path / "hf"), path, GGMLQuantizationType.Q5_0)
    kept = read_gguf(path, torch.float32, frozenset(GGUF_FORMATS)).weights
    expanded = read_gguf(path, torch.float32).weights  # every tensor dequantized by gguf-py
    projections = [n for n in kept if n.endswith("_proj.weight")]
    assert projections
    for name in projections:
        weight = kept[name]
        assert isinstance(weight, QuantizedTensor) and weight.format == Q8_0
        values = dequantize(weight.data.numpy(), GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(values, expanded[name].numpy())


def test_q5_0_blocks_are_quantized_as_gguf_py_writes_them() -> None:
    """The fixture's Q5_0 (gguf-py's quantize) reads back through the widening."""
    array = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    blocks = quantize(array, GGMLQuantizationType.Q5_0)
    widened = as_q8_0(blocks, GGMLQuantizationType.Q5_0, 4)
    np.testing.assert_array_equal(
        dequantize(widened, GGMLQuantizationType.Q8_0),
        dequantize(blocks, GGMLQuantizationType.Q5_0),
    )
