"""The int8 product of the K formats and the 32-value block formats (kernels/cpu/cpu_quant_i8gemm.c)
against its torch twin (kernels/reference/i8gemm_ref.py: the activations rounded to int8 per 256
or 32 values, the weights exact): within float32 rounding for weights of whole and partial
16-column panels, interleaved or as stored, rows of the 32-value block formats ending in a
partial super-block, activation row counts around its 4-row tiles, float32 and bfloat16
activations, bias, and outputs written into column slices; within the activations' rounding of
the exact product; and where the engine takes it (executor/layers/linear.py). The fast kernel runs where
the CPU has AVX-512 VNNI; the other builds run the scalar kernel of the same layout, tested on
every CPU."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine.executor.layers import linear as linear_module
from asyncengine.executor.layers.linear import (
    ROW_BLOCK,
    DenseBudget,
    QuantizedLinear,
    i8_below_rows,
    i8_from_rows,
    make_linear,
)
from asyncengine.kernels.cpu import quant_i8gemm_native, quant_native
from asyncengine.kernels.quant_formats import FORMATS
from asyncengine.kernels.reference import i8gemm_ref, quant_ref
from tests.kernels.test_quantized_kernels import product_scale, random_weight
from tests.native_support import needs_native

pytestmark = [
    needs_native,
    pytest.mark.usefixtures("without_amx"),  # the int8 product's paths where AMX would take them
]
needs_fast = pytest.mark.skipif(
    not quant_i8gemm_native.available(), reason="this CPU has no AVX-512 VNNI int8 product"
)
needs_k_format_i8 = pytest.mark.skipif(
    not quant_i8gemm_native.available(formats={"Q4_K", "Q6_K"}),
    reason="this CPU has no fast int8 product of the K formats (AVX-512 VNNI or AVX2)",
)
I8_FORMATS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
BLOCK32_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# rows of whole 32-value blocks ending in a partial super-block: 3, 9, 28 (Qwen2.5-0.5B's
# hidden) and 36 (Gemma 3 1B's) blocks
PARTIAL_COLS = (96, 288, 896, 1152)
# weight rows: half a panel, one, a panel and a half, odd pairs of panels, tails past the groups
WEIGHT_ROWS = (8, 16, 24, 44, 56)
ACTIVATION_ROWS = (1, 3, 4, 5, 9, 17, 33)


def _builds() -> list[str]:
    """The native build where it has the fast kernel, and always the AVX2 and scalar builds
    (the portable kernel; each build must keep compiling, whatever CPU runs the tests)."""
    return (["native"] if quant_i8gemm_native.available() else []) + ["avx2", "scalar"]


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize("name", I8_FORMATS)
def test_products_match_the_twin(name: str, isa: str) -> None:
    fmt = FORMATS[name]
    for cols in (256, 768):
        for rows in WEIGHT_ROWS:
            weight = random_weight(fmt, rows, cols, seed=rows * 31 + cols)
            bias = torch.randn(rows) if rows % 16 else None
            for stored in (weight, quant_native.interleave(weight)):
                panels = quant_i8gemm_native.pack(stored)
                assert panels.nbytes == quant_i8gemm_native.packed_bytes(stored)
                for n in ACTIVATION_ROWS:
                    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n + rows))
                    ref = i8gemm_ref.linear(x, weight, bias)
                    scale = product_scale(x, weight, bias)
                    y = quant_i8gemm_native.linear(x, panels, bias, isa=isa)
                    assert y.dtype == torch.float32 and y.shape == (n, rows)
                    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize("name", BLOCK32_FORMATS)
def test_block32_rows_of_a_partial_last_super_block(name: str, isa: str) -> None:
    """The panels' last super-block padded with zero blocks and the activations with zeros: the
    twin's product to float32 rounding, and the exact one within the activations' rounding, at
    1..4 rows (one tile) and more, float32 and bfloat16 activations, as stored or interleaved."""
    for cols in PARTIAL_COLS:
        weight = random_weight(FORMATS[name], 40, cols, seed=cols)
        exact_weight = quant_ref.dequantize(weight).double()
        bias = torch.randn(40, generator=torch.Generator().manual_seed(cols))
        for stored in (weight, quant_native.interleave(weight)):
            panels = quant_i8gemm_native.pack(stored)
            assert panels.nbytes == quant_i8gemm_native.packed_bytes(stored)
            for n in (1, 2, 3, 4, 5, 9, 33, 70):
                x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n + cols))
                x = x.to(torch.bfloat16).float() if n % 2 else x
                y = quant_i8gemm_native.linear(x, panels, bias, isa=isa).double()
                scale = product_scale(x, weight, bias)
                ref = i8gemm_ref.linear(x, weight, bias)
                torch.testing.assert_close(y, ref, rtol=0, atol=1e-5 * scale)
                exact = x.double() @ exact_weight.T + bias.double()
                bound = i8gemm_ref.rounding_bound(x, weight) + 1e-5 * scale
                assert bool(((y - exact).abs() <= bound).all()), (cols, n)
            x = torch.randn(6, cols).to(torch.bfloat16)
            y = quant_i8gemm_native.linear(x, panels, bias, isa=isa)
            ref = i8gemm_ref.linear(x.float(), weight, bias)
            scale = product_scale(x.float(), weight, bias)
            torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-5 * scale)


@needs_fast
@pytest.mark.parametrize("name", BLOCK32_FORMATS)
def test_the_fast_kernel_agrees_with_the_scalar_one_on_partial_super_blocks(name: str) -> None:
    """The VNNI kernel and the scalar one on the same padded panels: the same integer sums, the
    float ones to their order's rounding."""
    for cols in PARTIAL_COLS:
        weight = quant_native.interleave(random_weight(FORMATS[name], 56, cols, seed=cols + 1))
        panels = quant_i8gemm_native.pack(weight)
        for n in (1, 2, 3, 4, 7, 40):
            x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
            fast = quant_i8gemm_native.linear(x, panels)
            scalar = quant_i8gemm_native.linear(x, panels, isa="scalar")
            atol = 1e-5 * product_scale(x, weight, None)
            torch.testing.assert_close(fast, scalar, rtol=0, atol=atol)


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize("name", I8_FORMATS)
def test_long_rows_over_several_chunks(name: str, isa: str) -> None:
    """Rows of 10 super-blocks: up to 32 activation rows a unit takes them one at a time, more
    rows in chunks of several (the last one short), asking for the next while it multiplies;
    past 256 rows the rows in blocks (the last one short), each row as a call of it alone."""
    weight = random_weight(FORMATS[name], 40, 2560, seed=13)
    panels = quant_i8gemm_native.pack(quant_native.interleave(weight))
    bias = torch.randn(40)
    for n in (2, 32, 33, 70, 300):
        x = torch.randn(n, 2560, generator=torch.Generator().manual_seed(n))
        y = quant_i8gemm_native.linear(x, panels, bias, isa=isa)
        ref = i8gemm_ref.linear(x, weight, bias)
        scale = product_scale(x, weight, bias)
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * scale)
    assert torch.equal(quant_i8gemm_native.linear(x[257:], panels, bias, isa=isa), y[257:])


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_every_unit_of_panels_once_whatever_the_threads(name: str, isa: str) -> None:
    """Threads take the units of panels as they come free, each claiming its next one before it
    ends the last: 13 panels (7 units, the last of one panel) give the same bits on one thread
    as on three, and the twin's product."""
    weight = random_weight(FORMATS[name], 200, 768, seed=29)
    panels = quant_i8gemm_native.pack(quant_native.interleave(weight))
    threads = torch.get_num_threads()
    for n in (3, 32, 40):
        x = torch.randn(n, 768, generator=torch.Generator().manual_seed(n))
        outs = []
        try:
            for count in (1, 3):
                torch.set_num_threads(count)
                outs.append(quant_i8gemm_native.linear(x, panels, isa=isa))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(outs[0], outs[1])
        ref = i8gemm_ref.linear(x, weight)
        torch.testing.assert_close(
            outs[0].double(), ref, rtol=0, atol=1e-5 * product_scale(x, weight, None)
        )


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize(
    ("value_byte", "scale_byte", "sign"), [(0xFF, 0x80, 1.0), (0x00, 0x7F, -1.0)]
)
def test_q6_k_sums_at_their_extremes(
    isa: str, value_byte: int, scale_byte: int, sign: float
) -> None:
    """Q6_K's centred values (q - 32) meet the activations as unsigned bytes (x + 128): with every
    value, scale and activation at the end of its range the int32 sums stay exact."""
    weight = random_weight(FORMATS["Q6_K"], 16, 2048, seed=17)
    blocks = weight.data.view(16, 8, 210)
    blocks[:, :, :192] = value_byte  # ql, qh: every q 63 (0xFF) or 0
    blocks[:, :, 192:208] = scale_byte  # every sub-block scale -128 or 127
    x = torch.full((5, 2048), sign)
    ref = i8gemm_ref.linear(x, weight)
    y = quant_i8gemm_native.linear(x, quant_i8gemm_native.pack(weight), isa=isa)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_q4_k_sums_at_their_extremes(isa: str, sign: float) -> None:
    """Q4_K's sums of 16 nibble products are scaled in 16 bits (vpdpwssd): with every value 15,
    every scale and min 63 and every activation at +-127 they stay exact."""
    weight = random_weight(FORMATS["Q4_K"], 16, 2048, seed=23)
    blocks = weight.data.view(16, 8, 144)
    blocks[:, :, 4:] = 0xFF  # the 12 scale bytes (every 6-bit scale and min 63), every nibble 15
    x = torch.full((5, 2048), sign)
    ref = i8gemm_ref.linear(x, weight)
    y = quant_i8gemm_native.linear(x, quant_i8gemm_native.pack(weight), isa=isa)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize(("value_byte", "sign"), [(0x80, 1.0), (0x7F, -1.0), (0x80, -1.0)])
def test_q8_0_sums_at_their_extremes(isa: str, value_byte: int, sign: float) -> None:
    """Q8_0's values (s8) meet the activations as unsigned bytes (x + 128), the sums started at
    -128 times each block's sum of values: with every value -128 or 127 and every activation at
    +-127 the int32 sums stay exact."""
    weight = random_weight(FORMATS["Q8_0"], 16, 2048, seed=19)
    weight.data.view(16, 64, 34)[:, :, 2:] = value_byte
    x = torch.full((5, 2048), sign)
    ref = i8gemm_ref.linear(x, weight)
    y = quant_i8gemm_native.linear(x, quant_i8gemm_native.pack(weight), isa=isa)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q5_1"])
def test_block32_formats_at_every_row_count_of_a_tile(isa: str, name: str) -> None:
    """Every activation row count from 1 to 33 (whole and partial 4-row tiles, one super-block a
    chunk up to 32 rows, several from 33) and 70, on a weight of a partial last panel pair."""
    weight = random_weight(FORMATS[name], 40, 1280, seed=23)
    panels = quant_i8gemm_native.pack(quant_native.interleave(weight))
    bias = torch.randn(40)
    for n in (*range(1, 34), 70):
        x = torch.randn(n, 1280, generator=torch.Generator().manual_seed(n))
        y = quant_i8gemm_native.linear(x, panels, bias, isa=isa)
        ref = i8gemm_ref.linear(x, weight, bias)
        scale = product_scale(x, weight, bias)
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("isa", _builds())
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_bfloat16_rows_and_column_slices(isa: str, name: str) -> None:
    """bfloat16 activations are quantized as their float32 values, the output rounded once to
    bfloat16; an output view whose rows are longer gets only its columns."""
    weight = random_weight(FORMATS[name], 40, 512, seed=7)
    panels = quant_i8gemm_native.pack(weight)
    bias = torch.randn(40)
    x = torch.randn(6, 512).to(torch.bfloat16)
    ref = i8gemm_ref.linear(x.float(), weight, bias)
    scale = product_scale(x.float(), weight, bias)
    y = quant_i8gemm_native.linear(x, panels, bias, isa=isa)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-5 * scale)
    wide = torch.full((6, 50), 7.0, dtype=torch.bfloat16)
    quant_i8gemm_native.linear(x, panels, bias, out=wide[:, 5:45], isa=isa)
    assert torch.equal(wide[:, 5:45], y)
    assert bool((wide[:, :5] == 7).all()) and bool((wide[:, 45:] == 7).all())


@functools.cache
def _invariance_case(name: str) -> tuple[quant_i8gemm_native.I8Panels, torch.Tensor]:
    """Panels of 40 rows (a partial last pair of panels) x 10 super-blocks, and 300 input rows."""
    weight = quant_native.interleave(random_weight(FORMATS[name], 40, 2560, seed=31))
    x = torch.randn(300, 2560, generator=torch.Generator().manual_seed(5))
    x[:, 7] *= 30.0  # an outlier feature, as real activations have
    return quant_i8gemm_native.pack(weight), x


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(I8_FORMATS),
    isa=st.sampled_from(_builds()),
    start=st.integers(0, 299),
    size=st.integers(1, 300),
    bfloat16=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(
    name: str, isa: str, start: int, size: int, bfloat16: bool, threads: int
) -> None:
    """What deterministic mode takes it for (``QuantizedLinear``'s ``i8_every_row``): a row's
    output is the same bits alone as at any place of a call of any size, whatever the threads:
    its tiles of 4 rows, one or several super-blocks a chunk, blocks of 256 rows, float32 or
    bfloat16 in and out."""
    panels, x = _invariance_case(name)
    rows = x[start : start + size]
    if bfloat16:
        rows = rows.to(torch.bfloat16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = quant_i8gemm_native.linear(rows, panels, isa=isa)
    finally:
        torch.set_num_threads(previous)
    for i in {0, len(rows) // 2, len(rows) - 1}:
        alone = quant_i8gemm_native.linear(rows[i : i + 1], panels, isa=isa)
        assert torch.equal(out[i : i + 1], alone), (i, len(rows))


@needs_k_format_i8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deterministic_mode_takes_it_at_every_row_count(dtype: torch.dtype) -> None:
    """A projection made for deterministic mode (``make_linear`` with a row block) builds its
    panels whole when asked (the model asks once its weights are written; none deferred: a
    row's output must not depend on when it came) and takes the int8 product for one row as
    for many, its parts in two formats; the LM head's float32 logits too."""
    parts = [
        random_weight(FORMATS["Q4_K"], 32, 512, seed=3),
        random_weight(FORMATS["Q6_K"], 16, 512, seed=4),
    ]
    projection = make_linear(parts, None, dtype, row_block=ROW_BLOCK)
    assert isinstance(projection, QuantizedLinear)
    assert projection._i8 is None  # not from the parts' bytes before the model writes them
    assert projection.build_i8_every_row()
    assert projection._i8 is not None and not projection.defer_i8(dtype)
    assert projection.group_kernels_below(dtype) == 1
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = projection(x)
    for n in (1, 2, 5, 33):
        assert torch.equal(projection(x[:n]), out[:n])
    ref = torch.cat([i8gemm_ref.linear(x.float(), part, None) for part in parts], dim=1)
    atol = 1e-5 * max(product_scale(x.float(), part, None) for part in parts)
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=atol)
    logits = projection.float32_out(x[:1])
    assert logits.dtype == torch.float32 and torch.equal(logits, projection.float32_out(x)[:1])
    assert projection._dense is None


def test_deterministic_mode_keeps_the_group_kernels_without_the_panels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where this CPU has no fast int8 product, the budget refuses the panels or a part's
    format is not in I8_EVERY_ROW_FORMATS (Q4_1: its panels twice the file's bytes, half the
    group kernels' speed at one row), deterministic mode's projection takes the group kernels at
    every row count (also batch invariant)."""
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=6)
    x = torch.randn(40, 512)
    refused = QuantizedLinear([q4], budget=DenseBudget(0), i8_every_row=True)
    q4_1 = QuantizedLinear([random_weight(FORMATS["Q4_1"], 32, 512, seed=7)], i8_every_row=True)
    assert not q4_1.build_i8_every_row()
    monkeypatch.setattr(quant_i8gemm_native, "available", lambda **_: False)
    without = QuantizedLinear([q4], i8_every_row=True)
    for projection in (refused, q4_1, without):
        assert projection._i8 is None
        for n in (1, 40):
            assert torch.equal(projection(x[:n]), projection._quantized(x[:n]))


@needs_fast
@pytest.mark.parametrize("name", I8_FORMATS)
def test_within_the_activation_rounding_of_the_exact_product(name: str) -> None:
    """The weights are exact: only rounding the activations to int8 moves the outputs, by at most
    sum_k |W| d / 2 (plus float32 rounding)."""
    weight = random_weight(FORMATS[name], 48, 1024, seed=11)
    x = torch.randn(12, 1024, generator=torch.Generator().manual_seed(3))
    x[:, 5] *= 40.0  # an outlier feature: its super-block's scale is coarse, the others' not
    exact = x.double() @ quant_ref.dequantize(weight).double().T
    y = quant_i8gemm_native.linear(x, quant_i8gemm_native.pack(weight)).double()
    bound = i8gemm_ref.rounding_bound(x, weight) + 1e-5 * product_scale(x, weight, None)
    assert bool(((y - exact).abs() <= bound).all())
    assert float((y - exact).abs().max()) > 0  # the rounding is there: the bound is the real one


def test_what_it_takes() -> None:
    """The K formats' rows of whole super-blocks (as GGUF's always are), the 32-value block
    formats' rows of whole blocks (a partial last super-block padded: its panels' bytes too);
    nothing of the other formats."""
    assert quant_i8gemm_native.takes(random_weight(FORMATS["Q6_K"], 16, 256, seed=1))
    assert quant_i8gemm_native.takes(random_weight(FORMATS["Q8_0"], 16, 256, seed=1))
    for name in BLOCK32_FORMATS:
        partial = random_weight(FORMATS[name], 16, 288, seed=1)
        assert quant_i8gemm_native.takes(partial)
        whole = random_weight(FORMATS[name], 16, 512, seed=1)
        assert quant_i8gemm_native.packed_bytes(partial) == quant_i8gemm_native.packed_bytes(whole)
    i8 = random_weight(FORMATS["I8"], 16, 256, seed=1)
    assert not quant_i8gemm_native.takes(i8)
    with pytest.raises(ValueError, match="does not take"):
        quant_i8gemm_native.pack(i8)
    panels = quant_i8gemm_native.pack(random_weight(FORMATS["Q4_K"], 16, 256, seed=1))
    with pytest.raises(ValueError, match="columns"):
        quant_i8gemm_native.linear(torch.randn(2, 512), panels, isa="avx2")


@needs_fast
def test_the_engine_takes_it_between_the_crossovers(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the dense crossover a K-format projection takes the int8 product (no dense copy
    built), to its format's I8_BELOW_ROWS_BY_FORMAT; parts of several K formats take the
    smallest, part by part; a part in another format keeps the dense product for all. Every path
    agrees with the dequantized weights to its own rounding. (The limits here are small ones,
    so that the rows above them can be tried.)"""
    monkeypatch.setitem(linear_module.I8_BELOW_ROWS_BY_FORMAT, "Q4_K", 96)
    monkeypatch.setitem(linear_module.I8_BELOW_ROWS_BY_FORMAT, "Q6_K", 40)
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=2)
    q6 = random_weight(FORMATS["Q6_K"], 16, 512, seed=3)
    i8 = random_weight(FORMATS["I8"], 16, 512, seed=4)
    mixed = QuantizedLinear([q4, q6], torch.randn(48), dense_from_rows=8)
    below = linear_module.I8_BELOW_ROWS_BY_FORMAT["Q6_K"]
    assert mixed._i8_below == i8_below_rows(mixed.parts) == below
    assert QuantizedLinear([q4, i8], dense_from_rows=8)._i8_below == 0
    assert QuantizedLinear([q4], dense_from_rows=None)._i8_below == 0  # deterministic mode
    assert mixed.bias is not None
    both = torch.cat([quant_ref.dequantize(q4), quant_ref.dequantize(q6)])
    small = torch.randn(4, 512).to(torch.bfloat16)
    assert torch.equal(mixed(small), mixed._quantized(small))  # below the dense crossover
    assert mixed._i8 is None
    for n in (8, below - 1):
        x = torch.randn(n, 512).to(torch.bfloat16)
        out = mixed(x)
        ref = i8gemm_ref.linear(x.float(), q4, mixed.bias[:32])
        atol = 1e-5 * product_scale(x.float(), q4, mixed.bias[:32])
        torch.testing.assert_close(out[:, :32].double(), ref, rtol=2**-8, atol=atol)
        exact = x.double() @ both.double().T + mixed.bias.double()
        scale = float((x.double().abs() @ both.double().abs().T).max())
        torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=2e-2 * scale)
    assert mixed._i8 is not None and mixed._dense is None
    mixed(torch.randn(below, 512).to(torch.bfloat16))
    assert mixed._dense is not None


@needs_fast
def test_q8_0_takes_it_below_its_dense_crossover(monkeypatch: pytest.MonkeyPatch) -> None:
    """With bfloat16 activations a Q8_0 projection takes the int8 product from
    I8_FROM_ROWS_BY_FORMAT's rows even where its dense crossover lies further (the group kernels
    below), up to I8_BELOW_ROWS_BY_FORMAT's (the dense product from there); with Q4_K parts
    beside it, from the later of the two starts; float32 activations keep the crossover."""
    monkeypatch.setitem(linear_module.I8_BELOW_ROWS_BY_FORMAT, "Q8_0", 40)
    start = linear_module.I8_FROM_ROWS_BY_FORMAT["Q8_0"]
    q8 = random_weight(FORMATS["Q8_0"], 48, 512, seed=6)
    q4 = random_weight(FORMATS["Q4_K"], 16, 512, seed=8)
    projection = QuantizedLinear([q8], torch.randn(48), dense_from_rows=32)
    assert projection._i8_from == i8_from_rows([q8]) == start
    later = max(start, linear_module.I8_FROM_ROWS_BY_FORMAT["Q4_K"])
    assert QuantizedLinear([q8, q4], dense_from_rows=32)._i8_from == later
    assert projection.bias is not None
    small = torch.randn(start - 1, 512).to(torch.bfloat16)
    assert torch.equal(projection(small), projection._quantized(small))
    single = torch.randn(start, 512)  # float32
    assert torch.equal(projection(single), projection._quantized(single))
    assert projection._i8 is None
    for n in (start, 17, 39):
        x = torch.randn(n, 512).to(torch.bfloat16)
        out = projection(x)
        ref = i8gemm_ref.linear(x.float(), q8, projection.bias)
        atol = 1e-5 * product_scale(x.float(), q8, projection.bias)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=atol)
    assert projection._i8 is not None and projection._dense is None
    projection(torch.randn(40, 512).to(torch.bfloat16))
    assert projection._dense is not None


@pytest.mark.parametrize("width", [512, 256])
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_float32_rows_take_it_below_the_dense_crossover_only_with_the_avx2_kernel(
    name: str, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 activations keep the group kernels below the dense crossover where the fast
    kernel is VNNI's; where it is the AVX2 one they take it from I8_FROM_ROWS_FLOAT32_AVX2."""
    monkeypatch.setattr(quant_i8gemm_native, "available", lambda **_: True)
    monkeypatch.setattr(quant_i8gemm_native, "kernel_width", lambda: width)
    start = linear_module.I8_FROM_ROWS_FLOAT32_AVX2[name]
    weight = random_weight(FORMATS[name], 32, 512, seed=13)
    projection = QuantizedLinear([weight], dense_from_rows=start + 8)
    below = torch.randn(start - 1, 512)
    assert torch.equal(projection(below), projection._quantized(below))
    at = torch.randn(start, 512)
    out = projection(at)
    if width == 512:
        assert projection._i8 is None
        assert projection.group_kernels_below(torch.float32) == start + 8
        return
    assert projection._i8 is not None and projection._dense is None
    assert projection.group_kernels_below(torch.float32) == start
    ref = i8gemm_ref.linear(at, weight, None)
    torch.testing.assert_close(
        out.double(), ref, rtol=0, atol=1e-5 * product_scale(at, weight, None)
    )


@needs_fast
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_formats_take_it_from_their_start_rows_below_the_dense_crossover(name: str) -> None:
    """A K-format projection with bfloat16 activations takes the group kernels below
    I8_FROM_ROWS_BY_FORMAT's rows and the int8 product from them, before its dense crossover."""
    start = linear_module.I8_FROM_ROWS_BY_FORMAT[name]
    weight = random_weight(FORMATS[name], 32, 512, seed=11)
    projection = QuantizedLinear([weight], dense_from_rows=start + 8)
    below = torch.randn(start - 1, 512).to(torch.bfloat16)
    assert torch.equal(projection(below), projection._quantized(below))
    assert projection._i8 is None
    for n in (start, start + 7):
        x = torch.randn(n, 512).to(torch.bfloat16)
        out = projection(x)
        assert projection._i8 is not None and projection._dense is None
        ref = i8gemm_ref.linear(x.float(), weight, None)
        atol = 1e-5 * product_scale(x.float(), weight, None)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=atol)


@needs_fast
def test_a_refused_q8_0_keeps_the_group_kernels_below_its_dense_crossover() -> None:
    q8 = random_weight(FORMATS["Q8_0"], 32, 512, seed=9)
    refused = QuantizedLinear([q8], dense_from_rows=16, budget=DenseBudget(0))
    x = torch.randn(8, 512).to(torch.bfloat16)
    assert torch.equal(refused(x), refused._quantized(x))
    assert refused._i8 is None and refused._i8_below == 0 and refused._dense is None
    assert torch.equal(refused(x), refused._quantized(x))  # it no longer asks
    assert refused._dense is None


@needs_fast
def test_a_budget_without_room_keeps_the_other_paths() -> None:
    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=5)
    refused = QuantizedLinear([q4], dense_from_rows=8, budget=DenseBudget(0))
    x = torch.randn(16, 512)
    assert torch.equal(refused(x), refused._quantized(x))
    assert refused._i8 is None and refused._i8_below == 0
    room = quant_i8gemm_native.packed_bytes(refused.parts[0])
    budget = DenseBudget(room)
    taken = QuantizedLinear([q4], dense_from_rows=8, budget=budget)
    taken(x)
    assert taken._i8 is not None and budget.left == 0


def test_without_the_fast_kernel_the_engine_keeps_its_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quant_i8gemm_native, "available", lambda **_: False)
    q4 = random_weight(FORMATS["Q4_K"], 16, 256, seed=4)
    assert i8_below_rows([q4]) == 0
    projection = QuantizedLinear([q4], dense_from_rows=8)
    assert projection._i8_below == 0
    projection(torch.randn(16, 256))
    assert projection._i8 is None and projection._dense is not None
