"""The K formats at the widths of real models' blocks (rows of 256-value super-blocks, hidden 512,
an MLP's 1536): weights quantized from float by kernels/reference/kquant_ref.py (valid GGUF
blocks: the ``gguf`` package's dequantizer reads them back within each format's rounding), and
the kernels' products (interleaved groups and rows as stored, every ISA path) against the float32
product of the dequantized weights, within the int8 activations' rounding."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.quant_formats import Q4_K, Q5_K, Q6_K
from asyncengine.kernels.reference import quant_ref
from asyncengine.kernels.reference.kquant_ref import quantize_k
from tests.kernels.test_quantized_kernels import ISAS
from tests.native_support import needs_native

pytestmark = needs_native
# root-mean-square error of the dequantized weights, relative to the weights' own: a plain
# round-to-nearest quantizer's (4, 5 and 6 bits: 15, 31 and 63 levels per sub-block)
WEIGHT_ERROR = {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.03}
# the product's error from the int8 activation blocks (round to nearest, 127 levels), relative
# to the product's scale (|x| |W|^T): ~5e-4 seen on every format and ISA
PRODUCT_ERROR = 2e-3


@pytest.mark.parametrize("fmt", [Q4_K, Q5_K, Q6_K], ids=lambda f: f.name)
def test_quantized_blocks_dequantize_to_the_weights(fmt: object) -> None:
    weight = torch.randn(24, 1536, generator=torch.Generator().manual_seed(1)) * 0.05
    blocks = quantize_k(weight, fmt)  # type: ignore[arg-type]
    back = quant_ref.dequantize(blocks)
    error = float(((back - weight) ** 2).mean().sqrt() / weight.std())
    assert error < WEIGHT_ERROR[blocks.format.name]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", [Q4_K, Q5_K, Q6_K], ids=lambda f: f.name)
def test_products_match_the_float32_product_of_the_dequantized_weights(
    fmt: object, isa: str
) -> None:
    gen = torch.Generator().manual_seed(2)
    for rows, cols, n in ((64, 512, 1), (40, 1536, 3), (19, 512, 8)):
        weight = quantize_k(torch.randn(rows, cols, generator=gen) * 0.05, fmt)  # type: ignore[arg-type]
        dense = quant_ref.dequantize(weight).double()
        x = torch.randn(n, cols, generator=gen)
        exact = (x.double() @ dense.T).float()
        scale = float((x.abs().double() @ dense.abs().T).max())
        packed = quant_native.interleave(weight, isa)
        assert packed.interleaved
        for w in (packed, weight):
            y = quant_native.quant_linear(x, w, isa=isa)
            assert float((y - exact).abs().max()) < PRODUCT_ERROR * scale
