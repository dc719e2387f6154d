"""Q5_0 and Q5_1 blocks (llama-quantize's blocks for rows whose length is not a multiple of 256,
in Q4_K_M and Q5_K_M files) are kept as the file stores them, read by their own kernels: not
widened to Q8_0, not dequantized; a tiny model's GGUF in either decodes on the fused step as the
torch path does (test_native_decode_odd_widths.py: against the dense path of the dequantized
weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from asyncengine.executor.loader import read_gguf
from asyncengine.kernels.quant_formats import GGUF_FORMATS, QuantizedTensor
from tests.executor.fused_step_checks import check_gguf_step
from tests.executor.test_gguf_shapes import make_hf, write_gguf
from tests.native_support import needs_native

Q5_KINDS = [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1]
NAME = "llama3_rope_gqa8_untied"  # its q/k rows unpermuted as blocks too


@pytest.mark.parametrize("kind", Q5_KINDS, ids=lambda k: k.name)
def test_q5_projections_are_kept_as_stored(kind: GGMLQuantizationType, tmp_path: Path) -> None:
    path = tmp_path / f"{kind.name}.gguf"
    write_gguf(NAME, make_hf(NAME, tmp_path / "hf"), path, kind)
    kept = read_gguf(path, torch.float32, frozenset(GGUF_FORMATS)).weights
    expanded = read_gguf(path, torch.float32).weights  # every tensor dequantized by gguf-py
    projections = [n for n in kept if n.endswith("_proj.weight")]
    assert projections
    for name in projections:
        weight = kept[name]
        assert isinstance(weight, QuantizedTensor), name
        assert weight.format == GGUF_FORMATS[int(kind)] and not weight.interleaved
        rows, cols = weight.shape
        assert weight.nbytes == rows * cols // 32 * weight.format.block_bytes
        values = dequantize(weight.data.numpy(), kind).reshape(rows, cols)
        np.testing.assert_array_equal(values, expanded[name].numpy())


@needs_native
@pytest.mark.parametrize("kind", Q5_KINDS, ids=lambda k: k.name)
def test_a_q5_gguf_decodes_on_the_fused_step(
    kind: GGMLQuantizationType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_gguf_step("gemma3_sliding_local_rope_linear", tmp_path, monkeypatch, kind)
