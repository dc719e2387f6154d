"""The batch-1 group kernels (kernels/cpu/cpu_quant_b1.h: one activation row against interleaved
Q8_0 / Q5_K / Q6_K groups, and Q4_K's) at the widths of real models (Qwen2.5-1.5B's hidden 1536
and MLP 8960, Llama-3.2-1B's 2048 and 8192, Llama-3.2-3B's 3072): against the float32 product of
the dequantized weights (within the int8 activations' rounding), bit for bit against the same
row in a batch (the tiled kernels), and against the rows as stored, on every ISA path."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.quant_formats import FORMATS
from asyncengine.kernels.reference import quant_ref
from tests.kernels.test_quantized_kernels import ISAS, product_scale, random_weight
from tests.native_support import needs_native

pytestmark = needs_native
WIDTHS = (1536, 2048, 3072, 8192, 8960)
# the product's error from the int8 activation blocks, relative to |x| |W|^T (as
# test_kquant_accuracy.py: ~5e-4 seen)
PRODUCT_ERROR = 2e-3


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_one_row_products_at_real_widths(name: str, isa: str) -> None:
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(7)
    for cols in WIDTHS:
        rows = 19  # two groups of 8 and three rows as stored
        weight = random_weight(fmt, rows, cols, seed=cols)
        packed = quant_native.interleave(weight, isa)
        x = torch.randn(4, cols, generator=gen)
        exact = (x.double() @ quant_ref.dequantize(weight).double().T).float()
        scale = product_scale(x, weight, None)
        batch = quant_native.quant_linear(x, packed, isa=isa)
        for i in range(x.shape[0]):
            alone = quant_native.quant_linear(x[i : i + 1], packed, isa=isa)
            assert float((alone[0] - exact[i]).abs().max()) < PRODUCT_ERROR * scale
            assert torch.equal(alone[0], batch[i]), f"{name} width {cols} row {i}"
            as_stored = quant_native.quant_linear(x[i : i + 1], weight, isa=isa)
            torch.testing.assert_close(alone, as_stored, rtol=2e-5, atol=2e-5 * scale)
