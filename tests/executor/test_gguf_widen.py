"""IQ4_NL blocks (a non-linear 4-bit format) are kept as Q8_0 blocks of exactly their values
(asyncengine/executor/loader/gguf_widen.py, kernels/cpu/cpu_weight_pack.c), not dequantized to
the model's dtype; Q5_0 (which has its own kernels: tests/executor/test_gguf_q5.py) is not
widened."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from asyncengine.executor.loader import gguf_loader, read_gguf
from asyncengine.executor.loader.gguf_widen import as_q8_0
from asyncengine.kernels.cpu.weight_pack_native import widen_q8_0
from asyncengine.kernels.quant_formats import GGUF_FORMATS, Q8_0, QuantizedTensor
from tests.executor.test_gguf_shapes import make_hf, write_gguf


def _blocks(tensor_type: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """Every value byte of every block position taking all 256 bit patterns (block b's byte j is
    (b + 7j) % 256, then random bytes), beside finite fp16 scales of either sign."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    n = rows * cols // block
    rng = np.random.default_rng(int(tensor_type))
    blocks = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    sweep = (np.arange(n)[:, None] + 7 * np.arange(block_bytes)[None, :]) % 256
    blocks[: min(n, 256)] = sweep[:256]
    scales = rng.normal(0, 0.05, n).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


WIDENED = [GGMLQuantizationType.IQ4_NL]


# a few blocks; an odd number of them (8259); one alone; 256 blocks of one each
@pytest.mark.parametrize("rows, cols", [(6, 96), (3, 32 * 2753), (1, 32), (256, 32)])
@pytest.mark.parametrize("tensor_type", WIDENED)
def test_widened_blocks_hold_exactly_the_values_of_the_blocks_read(
    tensor_type: GGMLQuantizationType, rows: int, cols: int
) -> None:
    blocks = _blocks(tensor_type, rows, cols)
    widened = as_q8_0(blocks, tensor_type, rows)
    assert widened.shape == (rows, Q8_0.row_bytes(cols))
    got = dequantize(widened, GGMLQuantizationType.Q8_0)
    want = dequantize(blocks, tensor_type)
    np.testing.assert_array_equal(got, want)
    block_bytes = gguf.GGML_QUANT_SIZES[tensor_type][1]
    scales = blocks.reshape(-1, block_bytes)[:, :2]
    np.testing.assert_array_equal(widened.reshape(-1, Q8_0.row_bytes(32))[:, :2], scales)


@pytest.mark.parametrize("tensor_type", WIDENED)
def test_widening_a_map_view_copies_nothing_of_it(tensor_type: GGMLQuantizationType) -> None:
    """A read-only view (as the file's map gives) is read in place and left as it was."""
    blocks = _blocks(tensor_type, 2, 64)
    view = blocks.copy()
    view.flags.writeable = False
    np.testing.assert_array_equal(
        as_q8_0(view, tensor_type, 2), as_q8_0(blocks.copy(), tensor_type, 2)
    )
    np.testing.assert_array_equal(view, blocks)


def test_blocks_of_another_size_or_type_are_refused() -> None:
    blocks = _blocks(GGMLQuantizationType.Q5_0, 2, 64)
    with pytest.raises(ValueError, match="GGUF type 20"):
        widen_q8_0(blocks.reshape(-1, 22), int(GGMLQuantizationType.IQ4_NL))
    with pytest.raises(ValueError, match="GGUF type 8"):
        widen_q8_0(np.zeros((2, 34), np.uint8), int(GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="GGUF type 6"):
        widen_q8_0(blocks.reshape(-1, 22), int(GGMLQuantizationType.Q5_0))
    for kept in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0):
        with pytest.raises(ValueError, match="not widened"):
            as_q8_0(blocks, kept, 2)


def test_iq4_nl_projections_are_kept_as_q8_0_blocks_of_their_values(tmp_path: Path) -> None:
    name = "llama3_rope_gqa8_untied"  # its q/k rows unpermuted as blocks too
    path = tmp_path / "iq4_nl.gguf"
    write_gguf(name, make_hf(name, tmp_path / "hf"), path, GGMLQuantizationType.IQ4_NL)
    kept = read_gguf(path, torch.float32, frozenset(GGUF_FORMATS)).weights
    expanded = read_gguf(path, torch.float32).weights  # every tensor dequantized by gguf-py
    projections = [n for n in kept if n.endswith("_proj.weight")]
    assert projections
    for name in projections:
        weight = kept[name]
        assert isinstance(weight, QuantizedTensor) and weight.format == Q8_0
        values = dequantize(weight.data.numpy(), GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(values, expanded[name].numpy())


def test_without_the_native_library_iq4_nl_projections_are_dequantized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "llama3_rope_gqa8_untied"
    path = tmp_path / "iq4_nl.gguf"
    write_gguf(name, make_hf(name, tmp_path / "hf"), path, GGMLQuantizationType.IQ4_NL)
    monkeypatch.setattr(gguf_loader, "widening_available", lambda: False)
    kept = read_gguf(path, torch.float32, frozenset(GGUF_FORMATS)).weights
    expanded = read_gguf(path, torch.float32).weights
    projections = [n for n in kept if n.endswith("_proj.weight")]
    assert projections
    for name in projections:
        assert isinstance(kept[name], torch.Tensor)
        torch.testing.assert_close(kept[name], expanded[name], rtol=0, atol=0)
