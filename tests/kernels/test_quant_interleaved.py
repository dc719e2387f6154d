"""Quantized weights in interleaved groups of 8 rows (kernels/cpu/cpu_quant_blocks.h): the packing
against the torch reference's own reading of the layout, and every product and lookup on the
packed form against the torch reference, for row counts that are not whole groups, every
activation row count the small-batch paths take, and every ISA path this CPU can run."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.quant_formats import (
    FORMATS,
    INTERLEAVED_FORMATS,
    INTERLEAVED_ROWS,
    cat_rows,
)
from asyncengine.kernels.reference import quant_ref
from tests.kernels.test_quantized_kernels import ISAS, product_scale, random_weight
from tests.native_support import needs_native

pytestmark = needs_native
ROW_COUNTS = (1, 7, 8, 9, 16, 17, 24, 33, 47)


def widths(name: str) -> tuple[int, ...]:
    """Row widths of whole blocks: the K formats' blocks hold 256 values."""
    return (256, 512) if FORMATS[name].block_size == 256 else (32, 96, 576)


@pytest.mark.parametrize("name", sorted(INTERLEAVED_FORMATS))
def test_packing_is_the_layout_the_reference_reads(name: str) -> None:
    fmt = FORMATS[name]
    for rows in ROW_COUNTS:
        weight = random_weight(fmt, rows, widths(name)[-1], seed=rows)
        packed = quant_native.interleave(weight)
        assert packed.interleaved and packed.data.shape == weight.data.shape
        grouped = rows // INTERLEAVED_ROWS * INTERLEAVED_ROWS
        if grouped:  # the groups' bytes moved (same multiset per group), the tail did not
            assert not torch.equal(packed.data[:grouped], weight.data[:grouped])
        assert torch.equal(packed.data[grouped:], weight.data[grouped:])
        assert torch.equal(quant_ref.deinterleave(packed).data, weight.data)


def test_formats_without_the_layout_stay_as_they_are() -> None:
    for name in sorted(set(FORMATS) - INTERLEAVED_FORMATS):
        fmt = FORMATS[name]
        weight = random_weight(fmt, 9, 256, seed=1)
        assert quant_native.interleave(weight) is weight


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(INTERLEAVED_FORMATS))
def test_products_on_the_packed_rows_match_the_reference(name: str, isa: str) -> None:
    fmt = FORMATS[name]
    for cols in widths(name):
        for rows in ROW_COUNTS:
            for n in (1, 2, 5):
                weight = random_weight(fmt, rows, cols, seed=rows * 7 + cols + n)
                packed = quant_native.interleave(weight, isa)
                x = torch.randn(n, cols, generator=torch.Generator().manual_seed(rows + n))
                bias = torch.randn(rows) if rows % 2 else None
                ref = quant_ref.quant_matmul(x, weight, bias)
                scale = product_scale(x, weight, bias)
                row_by_row = quant_native.quant_matmul(x, weight, bias, isa=isa)
                for y in (
                    quant_native.quant_matmul(x, packed, bias, isa=isa),
                    quant_native.quant_linear(x, packed, bias, isa=isa),
                ):
                    torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * scale)
                    torch.testing.assert_close(y, row_by_row, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(INTERLEAVED_FORMATS))
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(name: str, isa: str) -> None:
    """Batch invariance, bit for bit: a row alone (the one-row kernel), in a tile of 2-4 rows
    (the register-tiled kernels, whose tail tiles repeat their last row; the K formats' AVX-512
    ones take 2-8), among other rows or in another position gives the same output."""
    fmt = FORMATS[name]
    cols = widths(name)[-1]
    weight = quant_native.interleave(random_weight(fmt, 40, cols, seed=3), isa)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(70, cols, generator=gen)  # over one chunk of 64 activation rows
    full = quant_native.quant_linear(x, weight, isa=isa)
    ref = quant_ref.quant_matmul(x, weight)
    torch.testing.assert_close(full, ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()))
    for i in (0, 1, 2, 3, 4, 10, 63, 64, 67, 68, 69):
        alone = quant_native.quant_linear(x[i : i + 1], weight, isa=isa)
        assert torch.equal(alone[0], full[i])
    for n in (2, 3, 4, 5, 6, 7, 8, 9):  # x[0] first of n rows, the others replaced by new ones
        others = torch.randn(n - 1, cols, generator=gen)
        y = quant_native.quant_linear(torch.cat([x[:1], others]), weight, isa=isa)
        assert torch.equal(y[0], full[0])
        last = quant_native.quant_linear(torch.cat([others, x[:1]]), weight, isa=isa)
        assert torch.equal(last[-1], full[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(INTERLEAVED_FORMATS))
def test_lookups_read_the_packed_rows_exactly(name: str, isa: str) -> None:
    weight = random_weight(FORMATS[name], 19, widths(name)[-1], seed=5)
    packed = quant_native.interleave(weight, isa)
    rows = torch.tensor([18, 0, 7, 8, 3, 16, 15, 3])  # groups 0 and 1, the tail, repeats
    expected = quant_native.dequantize_rows(weight, rows, isa=isa)
    assert torch.equal(quant_native.dequantize_rows(packed, rows, isa=isa), expected)
    assert torch.equal(
        quant_native.dequantize_rows(packed, None, isa=isa), quant_ref.dequantize(weight)
    )
    bf16 = quant_native.dequantize_rows(packed, rows, torch.bfloat16, isa=isa)
    assert torch.equal(bf16, expected.to(torch.bfloat16))


def test_byte_row_operations_refuse_packed_rows() -> None:
    packed = quant_native.interleave(random_weight(FORMATS["Q4_1"], 16, 64, seed=1))
    with pytest.raises(ValueError, match="interleaved"):
        packed.select_rows(torch.tensor([0]))
    with pytest.raises(ValueError, match="interleaved"):
        cat_rows([packed, packed])
    with pytest.raises(ValueError, match="no interleaved layout"):
        type(packed)(FORMATS["I8"], torch.zeros(1, 36, dtype=torch.uint8), 32, True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q5_0", "Q5_1"])
def test_q5_sums_at_their_extremes(name: str, isa: str) -> None:
    """Every value 31 (all nibbles 15, every fifth bit set) against activations all at +127 (or
    alternating signs within a block's halves): a block's pair products sum past an int16, which
    the AVX2 kernels must widen; the row, paired-row, group and tiled kernels all against the
    reference, stored and packed."""
    fmt = FORMATS[name]
    rows, cols = 17, 96
    weight = random_weight(fmt, rows, cols, seed=9)
    blocks = weight.data.reshape(rows, cols // 32, fmt.block_bytes)
    high_at = 2 if name == "Q5_0" else 4
    blocks[:, :, high_at:] = 0xFF  # qh and nibbles: every value 31
    for x in (torch.full((5, cols), 3.0), torch.tensor([1.0, -1.0]).repeat(5, cols // 2)):
        ref = quant_ref.quant_matmul(x, weight)
        scale = product_scale(x, weight, None)
        for stored in (weight, quant_native.interleave(weight, isa)):
            for n in (1, 2, 4, 5):
                y = quant_native.quant_linear(x[:n], stored, isa=isa)
                torch.testing.assert_close(y, ref[:n], rtol=2e-5, atol=2e-5 * scale)
