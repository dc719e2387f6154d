"""The K formats' AMX product (kernels/cpu/cpu_quant_amx.c) against the GGUF-dequantized float32
weights: with the weights and activations rounded to bfloat16 as the kernel takes them, the sums
agree to float32 rounding, for weights of whole and half 16-row blocks, odd pairs of blocks,
activation row counts around its 16-row tiles, float32 and bfloat16 activations, bias, and
outputs written into column slices; and where the engine takes it (executor/layers/linear.py).
On a CPU without AMX the product is not offered, which the last test checks."""

from __future__ import annotations

import pytest
import torch

from asyncengine.executor.layers import linear as linear_module
from asyncengine.executor.layers.linear import QuantizedLinear, k_amx_below_rows
from asyncengine.kernels.cpu import cpu_native, quant_amx_native, quant_i8gemm_native, quant_native
from asyncengine.kernels.quant_formats import FORMATS
from asyncengine.kernels.reference import quant_ref
from tests.kernels.test_quantized_kernels import product_scale, random_weight

pytestmark = pytest.mark.skipif(
    not cpu_native.compiler_found(), reason="no C compiler: the native kernels cannot be built"
)
needs_amx = pytest.mark.skipif(
    not quant_amx_native.available(), reason="this CPU (or kernel) does not run AMX"
)
K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")
# weight rows: one group (half a block), whole blocks, a block and a half, odd pairs of blocks
WEIGHT_ROWS = (8, 16, 24, 40, 56)
ACTIVATION_ROWS = (1, 7, 15, 16, 17, 32, 33, 47, 64, 100)


def reference(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) in float64, x and the dequantized W rounded to bfloat16 first."""
    w = quant_ref.dequantize(weight).to(torch.bfloat16).double()
    out = x.to(torch.bfloat16).double() @ w.T
    return out if bias is None else out + bias.double()


@needs_amx
@pytest.mark.parametrize("name", K_FORMATS)
def test_products_match_the_dequantized_weights(name: str) -> None:
    fmt = FORMATS[name]
    for cols in (256, 768):
        for rows in WEIGHT_ROWS:
            weight = random_weight(fmt, rows, cols, seed=rows * 31 + cols)
            packed = quant_native.interleave(weight)
            assert quant_amx_native.takes(packed)
            bias = torch.randn(rows) if rows % 16 else None
            for n in ACTIVATION_ROWS:
                x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n + rows))
                ref = reference(x, weight, bias)
                scale = product_scale(x, weight, bias)
                y = quant_amx_native.linear(x, packed, bias)
                assert y.dtype == torch.float32 and y.shape == (n, rows)
                torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * scale)
                yb = quant_amx_native.linear(x.to(torch.bfloat16), packed, bias)
                assert yb.dtype == torch.bfloat16
                # the same sums, rounded once more to bfloat16 on the way out
                torch.testing.assert_close(yb.double(), ref, rtol=2**-7, atol=1e-5 * scale)


@needs_amx
@pytest.mark.parametrize("name", K_FORMATS)
def test_rows_do_not_depend_on_each_other_or_the_thread_count(name: str) -> None:
    """Bit for bit: a row alone or among 40 others, in any position, on 1 or 2 threads."""
    weight = quant_native.interleave(random_weight(FORMATS[name], 48, 512, seed=5))
    x = torch.randn(41, 512, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant_amx_native.linear(x[i : i + 1], weight) for i in range(41)])
        together = quant_amx_native.linear(x, weight)
        torch.set_num_threads(2)
        two_threads = quant_amx_native.linear(x, weight)
        shuffled = quant_amx_native.linear(x.flip(0), weight).flip(0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)
    assert torch.equal(together, two_threads)
    assert torch.equal(together, shuffled)


@needs_amx
@pytest.mark.parametrize("name", K_FORMATS)
def test_one_pass_rows_stream_across_pairs_and_super_blocks(name: str) -> None:
    """Up to 32 rows, each thread unpacks its blocks a quarter super-block at a time, the
    stream running on from one pair of blocks into the next: with several pairs per thread
    (72 rows: four and a half blocks), an odd count of super-blocks (1280 columns) and 1 or 2
    threads, its rows agree with the dequantized weights and are bit for bit the rows of the
    many-row path (the same rows among 40)."""
    fmt = FORMATS[name]
    weight = random_weight(fmt, 72, 1280, seed=11)
    packed = quant_native.interleave(weight)
    bias = torch.randn(72)
    x = torch.randn(40, 1280, generator=torch.Generator().manual_seed(12))
    scale = product_scale(x, weight, bias)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            many = quant_amx_native.linear(x, packed, bias)
            for n in (5, 16, 29, 32):
                y = quant_amx_native.linear(x[:n], packed, bias)
                assert torch.equal(y, many[:n])
                torch.testing.assert_close(
                    y.double(), reference(x[:n], weight, bias), rtol=0, atol=1e-5 * scale
                )
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_output_into_a_column_slice_leaves_the_other_columns() -> None:
    weight = quant_native.interleave(random_weight(FORMATS["Q4_K"], 24, 256, seed=9))
    x = torch.randn(19, 256).to(torch.bfloat16)
    out = torch.full((19, 40), 7.0, dtype=torch.bfloat16)
    quant_amx_native.linear(x, weight, None, out[:, 10:34])
    assert torch.equal(out[:, 10:34], quant_amx_native.linear(x, weight))
    assert bool((out[:, :10] == 7).all()) and bool((out[:, 34:] == 7).all())


@needs_amx
def test_weights_it_cannot_take_are_refused() -> None:
    plain = random_weight(FORMATS["Q4_K"], 16, 256, seed=1)  # not interleaved
    assert not quant_amx_native.takes(plain)
    with pytest.raises(ValueError, match="does not take"):
        quant_amx_native.linear(torch.randn(2, 256), plain)
    tail = quant_native.interleave(random_weight(FORMATS["Q4_K"], 12, 256, seed=1))
    assert not quant_amx_native.takes(tail)  # 12 rows: not whole groups of 8
    q8 = quant_native.interleave(random_weight(FORMATS["Q8_0"], 16, 256, seed=1))
    assert not quant_amx_native.takes(q8)
    packed = quant_native.interleave(plain)
    with pytest.raises(ValueError, match="columns"):
        quant_amx_native.linear(torch.randn(2, 512), packed)


@needs_amx
def test_the_projection_takes_it_between_the_crossover_and_its_limit() -> None:
    """A Q4_K projection with bfloat16 rows: the q8 kernel below its crossover, the AMX product
    from it (no dense copy built), the dense product from its AMX crossover. Parts of several K
    formats (q/k in Q4_K, v in Q6_K) take it part by part; a part in another format keeps the
    dense product for all. Every path agrees with the dequantized weights to bfloat16 rounding."""
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=2)
    q6 = random_weight(FORMATS["Q6_K"], 16, 512, seed=3)
    q8 = random_weight(FORMATS["Q8_0"], 16, 512, seed=4)
    projection = QuantizedLinear([q4], dense_from_rows=8)
    mixed = QuantizedLinear([q4, q6], torch.randn(48), dense_from_rows=8)
    assert projection._amx and mixed._amx
    assert not QuantizedLinear([q4, q8], dense_from_rows=8)._amx
    below = projection._amx_below
    assert below == k_amx_below_rows(projection.parts) > 31
    x = torch.randn(40, 512).to(torch.bfloat16)
    assert mixed.bias is not None
    both = torch.cat([quant_ref.dequantize(q4), quant_ref.dequantize(q6)])
    ref = x.double() @ both.to(torch.bfloat16).double().T + mixed.bias.double()
    torch.testing.assert_close(
        mixed(x).double(),
        ref,
        rtol=2**-7,
        atol=1e-5 * float((x.double().abs() @ both.double().abs().T).max()),
    )
    assert mixed._dense is None
    small = torch.randn(4, 512).to(torch.bfloat16)
    assert torch.equal(projection(small), quant_native.quant_linear(small, projection.parts[0]))
    for n in (8, 31, below - 1):
        x = torch.randn(n, 512).to(torch.bfloat16)
        assert torch.equal(projection(x), quant_amx_native.linear(x, projection.parts[0]))
        torch.testing.assert_close(
            projection(x).double(),
            reference(x, q4, None),
            rtol=2**-7,
            atol=1e-5 * product_scale(x, q4, None),
        )
    assert projection._dense is None  # the AMX product needs no dense copy
    x = torch.randn(below, 512).to(torch.bfloat16)
    projection(x)
    assert projection._dense is not None


def test_the_amx_crossover_is_per_format_and_shape() -> None:
    """Narrow and wide projections (outputs per input) have their own crossovers per format; a
    projection of several formats takes the smallest; a format without an entry the default."""
    table = linear_module.K_AMX_BELOW_ROWS_BY_FORMAT
    wide_ratio = linear_module.K_AMX_WIDE_RATIO
    for name in K_FORMATS:
        narrow = random_weight(FORMATS[name], 32, 512, seed=5)
        wide = random_weight(FORMATS[name], wide_ratio * 256, 256, seed=6)
        assert k_amx_below_rows([narrow]) == table[name][0]
        assert k_amx_below_rows([wide]) == table[name][1]
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=7)
    q6 = random_weight(FORMATS["Q6_K"], 16, 512, seed=8)
    assert k_amx_below_rows([q4, q6]) == min(table["Q4_K"][0], table["Q6_K"][0])
    q4_1 = random_weight(FORMATS["Q4_1"], 16, 512, seed=9)
    assert k_amx_below_rows([q4_1]) == linear_module.K_AMX_BELOW_ROWS


@needs_amx
@pytest.mark.parametrize("name", K_FORMATS)
@pytest.mark.parametrize("wide", [False, True])
def test_both_sides_of_the_amx_crossover_agree(name: str, wide: bool) -> None:
    """One row below the crossover (the AMX product, no dense copy) and at it (the dense bfloat16
    product of the dequantized weight) the projection agrees with the bfloat16-rounded reference
    to bfloat16 rounding, and a row given to both calls comes out the same to that tolerance."""
    cols = 256
    rows = linear_module.K_AMX_WIDE_RATIO * cols if wide else 48
    weight = random_weight(FORMATS[name], rows, cols, seed=rows + len(name))
    bias = torch.randn(rows)
    projection = QuantizedLinear([weight], bias, dense_from_rows=8)
    below = projection._amx_below
    assert below == linear_module.K_AMX_BELOW_ROWS_BY_FORMAT[name][wide]
    x = torch.randn(below, cols, generator=torch.Generator().manual_seed(below)).to(torch.bfloat16)
    amx_side = projection(x[: below - 1])
    assert projection._dense is None
    assert torch.equal(
        amx_side, quant_amx_native.linear(x[: below - 1], projection.parts[0], projection.bias)
    )
    dense_side = projection(x)
    assert projection._dense is not None
    scale = product_scale(x, weight, bias)
    for side, n in ((amx_side, below - 1), (dense_side, below)):
        torch.testing.assert_close(
            side.double(), reference(x[:n], weight, bias), rtol=2**-7, atol=1e-5 * scale
        )
    torch.testing.assert_close(
        amx_side.double(), dense_side[: below - 1].double(), rtol=2**-7, atol=1e-5 * scale
    )


def test_without_amx_the_projection_keeps_the_dense_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quant_amx_native, "available", lambda: False)
    monkeypatch.setattr(quant_i8gemm_native, "available", lambda: False)
    q4 = random_weight(FORMATS["Q4_K"], 16, 256, seed=4)
    projection = QuantizedLinear([q4], dense_from_rows=8)
    assert not projection._amx
    x = torch.randn(16, 256).to(torch.bfloat16)
    torch.testing.assert_close(
        projection(x).double(),
        reference(x, q4, None),
        rtol=2**-7,
        atol=1e-5 * product_scale(x, q4, None),
    )
    assert projection._dense is not None
