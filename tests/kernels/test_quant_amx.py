"""The AMX product of the GGUF block formats (kernels/cpu/cpu_quant_amx.c) against the
GGUF-dequantized float32 weights: with the weights and activations rounded to bfloat16 as the kernel takes them, the sums
agree to float32 rounding, for weights of whole and half 16-row blocks, odd pairs of blocks,
activation row counts around its 16-row tiles, float32 and bfloat16 activations, bias, and
outputs written into column slices; and where the engine takes it (executor/layers/linear.py).
On a CPU without AMX the product is not offered, which the last test checks."""

from __future__ import annotations

import pytest
import torch

from asyncengine.executor.layers import linear as linear_module
from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.kernels.cpu import cpu_native, quant_amx_native, quant_i8gemm_native, quant_native
from asyncengine.kernels.quant_formats import FORMATS
from asyncengine.kernels.reference import quant_ref
from tests.kernels.test_quantized_kernels import product_scale, random_weight
from tests.native_support import needs_native

pytestmark = needs_native
needs_amx = pytest.mark.skipif(
    not quant_amx_native.available(), reason="this CPU (or kernel) does not run AMX"
)
K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")
BLOCK_FORMATS = ("Q8_0", "Q4_0", "Q4_1")  # 32 values a block
# weight rows: one group (half a block), whole blocks, a block and a half, odd pairs of blocks
WEIGHT_ROWS = (8, 16, 24, 40, 56)
ACTIVATION_ROWS = (1, 7, 15, 16, 17, 32, 33, 47, 64, 100)


def reference(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) in float64, x and the dequantized W rounded to bfloat16 first."""
    w = quant_ref.dequantize(weight).to(torch.bfloat16).double()
    out = x.to(torch.bfloat16).double() @ w.T
    return out if bias is None else out + bias.double()


@needs_amx
@pytest.mark.parametrize("name", K_FORMATS + BLOCK_FORMATS)
def test_products_match_the_dequantized_weights(name: str) -> None:
    fmt = FORMATS[name]
    for cols in (256, 768) if name in K_FORMATS else (64, 576):
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
@pytest.mark.parametrize("name", K_FORMATS + BLOCK_FORMATS)
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
@pytest.mark.parametrize("name", K_FORMATS + BLOCK_FORMATS)
def test_float32_out_is_what_the_bfloat16_out_rounds(name: str) -> None:
    """bfloat16 rows into float32 sums (the LM head's logits): the sums as they are, which the
    bfloat16 output rounds; a float32 x writes float32 only."""
    cols = 512
    weight = random_weight(FORMATS[name], 40, cols, seed=13)
    packed = quant_native.interleave(weight)
    bias = torch.randn(40)
    for n in (7, 33, 100):
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        wide = quant_amx_native.linear(x, packed, bias, out_dtype=torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(wide.to(torch.bfloat16), quant_amx_native.linear(x, packed, bias))
        scale = product_scale(x.float(), weight, bias)
        torch.testing.assert_close(
            wide.double(), reference(x, weight, bias), rtol=0, atol=1e-5 * scale
        )
    with pytest.raises(ValueError, match="float32"):
        quant_amx_native.linear(torch.randn(2, cols), packed, out_dtype=torch.bfloat16)


@needs_amx
def test_the_lm_head_takes_float32_sums_from_every_part() -> None:
    """``float32_out`` on the AMX product's rows: each part's float32 sums in its columns (the
    int8 product's below them), what the bfloat16 output rounds."""
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=14)
    q6 = random_weight(FORMATS["Q6_K"], 16, 512, seed=15)
    projection = QuantizedLinear([q4, q6], torch.randn(48), dense_from_rows=8)
    for n in (8, 40):
        x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        logits = projection.float32_out(x)
        assert logits.dtype == torch.float32
        assert torch.equal(logits.to(torch.bfloat16), projection(x))
        if projection._product(n, torch.bfloat16) == projection._amx_product:
            assert projection.bias is not None
            parts = [
                quant_amx_native.linear(x, part, bias, out_dtype=torch.float32)
                for part, bias in zip(
                    projection.parts, projection.bias.split([32, 16]), strict=True
                )
            ]
            assert torch.equal(logits, torch.cat(parts, dim=1))
    assert projection._product(40, torch.bfloat16) == projection._amx_product


@needs_amx
def test_weights_it_cannot_take_are_refused() -> None:
    plain = random_weight(FORMATS["Q4_K"], 16, 256, seed=1)  # not interleaved
    assert not quant_amx_native.takes(plain)
    with pytest.raises(ValueError, match="does not take"):
        quant_amx_native.linear(torch.randn(2, 256), plain)
    tail = quant_native.interleave(random_weight(FORMATS["Q4_K"], 12, 256, seed=1))
    assert not quant_amx_native.takes(tail)  # 12 rows: not whole groups of 8
    i8 = random_weight(FORMATS["I8"], 16, 256, seed=1)
    assert not quant_amx_native.takes(i8)
    q8 = quant_native.interleave(random_weight(FORMATS["Q8_0"], 16, 288, seed=1))
    assert not quant_amx_native.takes(q8)  # 288 columns: not whole pairs of blocks
    packed = quant_native.interleave(plain)
    with pytest.raises(ValueError, match="columns"):
        quant_amx_native.linear(torch.randn(2, 512), packed)


@needs_amx
def test_the_projection_takes_it_from_its_crossover_at_every_size() -> None:
    """A Q4_K projection with bfloat16 rows: the group kernels below ``I8_FROM_ROWS_BY_FORMAT``,
    the int8 product up to ``AMX_FROM_ROWS_BY_FORMAT``, the AMX product from there at any row
    count (no dense copy built), which agrees with the dequantized weights to bfloat16 rounding.
    Parts of several formats (q/k in Q4_K, v in Q6_K) take it from the latest of their rows; a
    part in a format it does not take keeps the other products for all."""
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=2)
    q6 = random_weight(FORMATS["Q6_K"], 16, 512, seed=3)
    i8 = random_weight(FORMATS["I8"], 16, 512, seed=4)
    projection = QuantizedLinear([q4], dense_from_rows=8)
    mixed = QuantizedLinear([q4, q6], torch.randn(48), dense_from_rows=8)
    assert projection._amx and mixed._amx
    assert not QuantizedLinear([q4, i8], dense_from_rows=8)._amx
    start = linear_module.AMX_FROM_ROWS_BY_FORMAT["Q4_K"]
    assert mixed._amx_from == max(start, linear_module.AMX_FROM_ROWS_BY_FORMAT["Q6_K"])
    x = torch.randn(mixed._amx_from + 8, 512).to(torch.bfloat16)
    assert mixed.bias is not None
    both = torch.cat([quant_ref.dequantize(q4), quant_ref.dequantize(q6)])
    ref = x.double() @ both.to(torch.bfloat16).double().T + mixed.bias.double()
    torch.testing.assert_close(
        mixed(x).double(),
        ref,
        rtol=2**-7,
        atol=1e-5 * float((x.double().abs() @ both.double().abs().T).max()),
    )
    i8_from = linear_module.I8_FROM_ROWS_BY_FORMAT["Q4_K"]
    for n in (i8_from - 1, i8_from, start - 1, start, start + 5, 200, 600):
        x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        y = projection(x)
        if n < i8_from:  # the group kernels (tests/kernels/test_quantized_kernels.py)
            assert torch.equal(y, quant_native.quant_linear(x, projection.parts[0]))
            continue
        if n < start:  # its activations quantized to int8 (tests/kernels/test_quant_i8gemm.py)
            assert projection._i8 is not None
            assert torch.equal(y, projection._i8_product(x))
            continue
        assert torch.equal(y, quant_amx_native.linear(x, projection.parts[0]))
        torch.testing.assert_close(
            y.double(), reference(x, q4, None), rtol=2**-7, atol=1e-5 * product_scale(x, q4, None)
        )
    assert projection._dense is None and mixed._dense is None  # no dense copy
    # float32 activations take the int8 product past the dense crossover (the AMX product takes
    # bfloat16 rows), as on a CPU without AMX
    x = torch.randn(64, 512)
    assert torch.equal(projection(x), projection._i8_product(x))
    assert projection._dense is None


def assert_group_kernels_then_amx(
    projection: QuantizedLinear, cases: tuple[tuple[int, bool], ...]
) -> None:
    """Each (rows, group kernels) case: the projection's bfloat16 rows are the group kernels'
    output where True, the AMX product's where False (the two differ)."""
    for n, group_kernels in cases:
        x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        by_group = quant_native.quant_linear(x, projection.parts[0])
        by_amx = quant_amx_native.linear(x, projection.parts[0])
        assert not torch.equal(by_group, by_amx)
        assert torch.equal(projection(x), by_group if group_kernels else by_amx)


@needs_amx
def test_without_room_for_int8_panels_amx_takes_over_at_the_dense_crossover() -> None:
    """Where the budget refuses a K-format projection its int8 panels, the AMX product takes
    the rows from the dense crossover (it is the dense product's sums without a copy), the group
    kernels below it."""
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=5)
    projection = QuantizedLinear([q4], dense_from_rows=14, budget=linear_module.DenseBudget(0))
    assert 14 < linear_module.AMX_FROM_ROWS_BY_FORMAT["Q4_K"]
    i8_from = linear_module.I8_FROM_ROWS_BY_FORMAT["Q4_K"]
    assert_group_kernels_then_amx(
        projection, ((i8_from, True), (13, True), (14, False), (40, False))
    )
    assert projection._i8 is None and projection._dense is None


@needs_amx
def test_while_its_panels_are_built_amx_takes_the_rows_from_the_dense_crossover() -> None:
    """While a K-format projection's int8 panels are still being built (``defer_i8``), the calls
    that will take the int8 product take AMX from the dense crossover (the group kernels below
    it); once the calls have taken ``I8_DEFERRED_ROWS`` rows the panels are finished and the int8
    product takes them."""
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=6)
    projection = QuantizedLinear([q4], dense_from_rows=14)
    assert projection.defer_i8(torch.bfloat16)
    i8_from = linear_module.I8_FROM_ROWS_BY_FORMAT["Q4_K"]
    assert i8_from < 14 < 20 < linear_module.AMX_FROM_ROWS_BY_FORMAT["Q4_K"]
    assert_group_kernels_then_amx(
        projection, ((i8_from, True), (13, True), (14, False), (20, False))
    )
    assert projection.i8_deferred
    x = torch.randn(20, 512).to(torch.bfloat16)
    while projection.i8_deferred:
        projection(x)
    assert projection._product(20, torch.bfloat16) == projection._i8_product


@needs_amx
@pytest.mark.parametrize("name", K_FORMATS + BLOCK_FORMATS)
def test_int8_panels_are_built_only_where_some_rows_take_them(name: str) -> None:
    """A projection's panels are deferred for building (``defer_i8``) where some row count of
    the model's activations takes the int8 product: not for a bfloat16 Q4_1 model, whose AMX
    product starts at the int8 product's first rows; float32 rows (no AMX) take it."""
    weight = random_weight(FORMATS[name], 32, 512, seed=33)
    projection = QuantizedLinear([weight], None, dense_from_rows=32)
    starts = linear_module.I8_FROM_ROWS_BY_FORMAT[name]
    takes = starts < linear_module.AMX_FROM_ROWS_BY_FORMAT[name]
    assert takes == (name != "Q4_1")
    assert projection.takes_i8(torch.bfloat16) == takes == projection.defer_i8(torch.bfloat16)
    assert projection.takes_i8(torch.float32)
    fresh = QuantizedLinear([weight], None, dense_from_rows=32)  # builds panels when it needs them
    by_int8 = [fresh._product(n, torch.bfloat16) == fresh._i8_product for n in range(64)]
    assert any(by_int8) == takes


@needs_amx
@pytest.mark.parametrize("name", K_FORMATS + BLOCK_FORMATS)
def test_every_format_keeps_the_int8_product_below_its_amx_rows(name: str) -> None:
    """Every format with bfloat16 rows: the int8 product from its rows up to
    ``AMX_FROM_ROWS_BY_FORMAT``, the AMX product from there at any size; no dense copy."""
    assert quant_i8gemm_native.available()  # every AMX CPU has AVX-512 VNNI
    weight = random_weight(FORMATS[name], 32, 512, seed=31)
    projection = QuantizedLinear([weight], torch.randn(32), dense_from_rows=8)
    assert projection._amx
    start = linear_module.AMX_FROM_ROWS_BY_FORMAT[name]
    i8_from = linear_module.I8_FROM_ROWS_BY_FORMAT[name]
    for n in (i8_from, start - 1, start, 100):
        x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        y = projection(x)
        if n < start:  # its activations quantized to int8 (tests/kernels/test_quant_i8gemm.py)
            assert projection._i8 is not None
            assert torch.equal(y, projection._i8_product(x))
            continue
        assert torch.equal(y, quant_amx_native.linear(x, projection.parts[0], projection.bias))
        torch.testing.assert_close(
            y.double(),
            reference(x, weight, projection.bias),
            rtol=2**-7,
            atol=1e-5 * product_scale(x, weight, projection.bias),
        )
    assert projection._dense is None


@needs_amx
@pytest.mark.parametrize("name", K_FORMATS + BLOCK_FORMATS)
def test_panels_split_k_and_rows_without_changing_a_bit(name: str) -> None:
    """Past 32 rows the weights are unpacked a panel (blocks x a chunk of k) at a time, the sums
    of a longer k waiting between chunks: a build with small panels (4 blocks x 512 values: three
    chunks of a 1280-column weight, the last a ragged 256, and 72 rows in two panels, the second
    a block and a half) gives the same bits as the default's one chunk, on 1 and 2 threads; a
    k longer than the default's chunk (4352: two chunks and a ragged 256) agrees with the
    dequantized weights."""
    small_panels = quant_amx_native.declared(
        cpu_native.load("cpu_quant_amx", ("-DK_PANEL_K=512", "-DK_PANEL_BYTES=65536"))
    )
    assert small_panels is not None
    fmt = FORMATS[name]
    weight = random_weight(fmt, 72, 1280, seed=21)
    packed = quant_native.interleave(weight)
    bias = torch.randn(72)
    x = torch.randn(70, 1280, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    own = quant_amx_native._library
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            default = quant_amx_native.linear(x, packed, bias)
            quant_amx_native._library = lambda: small_panels  # type: ignore[assignment]
            chunked = quant_amx_native.linear(x, packed, bias)
            quant_amx_native._library = own
            assert torch.equal(chunked, default)
    finally:
        quant_amx_native._library = own
        torch.set_num_threads(threads)
    long_weight = random_weight(fmt, 24, 4352, seed=23)
    long_x = torch.randn(40, 4352, generator=torch.Generator().manual_seed(24))
    y = quant_amx_native.linear(long_x, quant_native.interleave(long_weight))
    torch.testing.assert_close(
        y.double(),
        reference(long_x, long_weight, None),
        rtol=0,
        atol=1e-5 * product_scale(long_x, long_weight, None),
    )


def test_without_amx_the_projection_keeps_the_dense_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quant_amx_native, "available", lambda: False)
    monkeypatch.setattr(quant_i8gemm_native, "available", lambda **_: False)
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


def test_q5_projections_keep_the_other_products_on_an_amx_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Q5_0 / Q5_1 have no AMX unpacking: on an AMX CPU a projection with a part in them (alone
    or beside a part AMX takes) keeps the int8 (or dense) product at every row count."""
    monkeypatch.setattr(quant_amx_native, "available", lambda: True)
    q4 = random_weight(FORMATS["Q4_K"], 16, 512, seed=1)
    assert QuantizedLinear([q4], dense_from_rows=8)._amx
    for name in ("Q5_0", "Q5_1"):
        q5 = random_weight(FORMATS[name], 16, 512, seed=2)
        assert not quant_amx_native.takes(quant_native.interleave(q5))
        for parts in ([q5], [q4, q5]):
            projection = QuantizedLinear(parts, dense_from_rows=8)
            assert not projection._amx
            assert projection._product(600, torch.bfloat16) != projection._amx_product
