"""Linear on the CPU: once its weight is packed for oneDNN it keeps only the packed copy (one
copy of the weights resident, not two), and still computes x @ W.T + b for any leading shape.
A float32 (bfloat16) model's projections become F32 (BF16) rows (``make_linear``) where the native
kernels are."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from asyncengine.executor.layers import linear as linear_module
from asyncengine.executor.layers.linear import (
    DENSE_FROM_ROWS_BY_FORMAT,
    Linear,
    QuantizedLinear,
    dense_from_rows,
    make_linear,
)
from asyncengine.kernels.quant_formats import BF16, F32
from tests.native_support import needs_native


def test_a_packed_linear_drops_the_plain_weight_and_multiplies_the_same() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    bias = torch.randn(96)
    x = torch.randn(5, 7, 64)
    want = F.linear(x, weight, bias)
    linear = Linear(weight.clone(), bias)
    assert linear.out_features == 96 and linear.dtype == torch.float32
    if linear.packed is None:  # a torch build without the mkldnn ops: the plain weight serves
        assert linear.weight is not None
    else:
        assert linear.weight is None
    torch.testing.assert_close(linear(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x[0]), want[0], rtol=1e-5, atol=1e-5)


def test_the_packed_linear_keeps_no_reference_to_the_weight_it_was_given() -> None:
    weight = torch.randn(32, 16)
    linear = Linear(weight)
    if linear.packed is None:
        return  # nothing packed: the weight is what it multiplies with (checked above)
    given = weakref.ref(weight)
    del weight
    gc.collect()
    assert given() is None
    assert linear(torch.ones(2, 16)).shape == (2, 32)


@needs_native
def test_float32_projections_are_f32_rows_with_a_dense_product_on_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dense float32 parts (q/k/v here) become one F32 QuantizedLinear: the native product below
    its crossover, the prepacked oneDNN product of the same weights from it, both x @ W.T + b.
    bf16, deterministic mode's row blocks and ASYNCENGINE_F32_ROWS=0 keep a dense Linear."""
    parts = [torch.randn(24, 40), torch.randn(8, 40), torch.randn(8, 40)]
    bias = torch.randn(40)
    fused = make_linear(parts, bias, torch.float32)
    assert isinstance(fused, QuantizedLinear)
    assert [p.format for p in fused.parts] == [F32]
    crossover = DENSE_FROM_ROWS_BY_FORMAT["F32"]
    assert fused.dense_from_rows == crossover
    weight = torch.cat(parts)
    for rows in (1, 3, crossover - 1, crossover, 3 * crossover):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(fused(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    dense = fused.dense(torch.float32)
    assert dense is fused.dense(torch.float32)  # packed once, then kept
    assert isinstance(make_linear(parts, None, torch.bfloat16), Linear)
    assert isinstance(make_linear(parts, None, torch.float32, row_block=32), Linear)
    monkeypatch.setenv(linear_module.FLOAT_ROWS_ENV, "0")
    assert isinstance(make_linear(parts, None, torch.float32), Linear)


@needs_native
def test_bfloat16_projections_are_bf16_rows_over_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dense bfloat16 parts of a bfloat16 model become one BF16 QuantizedLinear whose rows are
    the given bytes (no copy where there is one part): the native product (float32 sums of the
    stored values, rounded once) below its crossover, oneDNN's bfloat16 product from it; float32
    parts of a bfloat16 model, row blocks and ASYNCENGINE_F32_ROWS=0 keep a dense Linear."""
    weight = (torch.randn(40, 64) * 0.1).to(torch.bfloat16)
    bias = torch.randn(40).to(torch.bfloat16)
    one = make_linear([weight], bias, torch.bfloat16)
    assert isinstance(one, QuantizedLinear) and [p.format for p in one.parts] == [BF16]
    assert one.parts[0].data.data_ptr() == weight.data_ptr()
    parts = [weight[:24], weight[24:32], weight[32:]]
    fused = make_linear(parts, bias, torch.bfloat16)
    assert isinstance(fused, QuantizedLinear) and [p.format for p in fused.parts] == [BF16]
    crossover = dense_from_rows(fused.parts, torch.bfloat16)
    assert fused.dense_from_rows == crossover
    for rows in (1, crossover - 1, crossover, 3 * crossover):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        want = F.linear(x.double(), weight.double(), bias.double())
        got = fused(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
        if rows < crossover:  # float32 sums, one rounding: the nearest bfloat16 or next to it
            torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)
    assert isinstance(make_linear([weight.float()], None, torch.bfloat16), Linear)
    assert isinstance(make_linear([weight], None, torch.bfloat16, row_block=32), Linear)
    monkeypatch.setenv(linear_module.FLOAT_ROWS_ENV, "0")
    assert isinstance(make_linear([weight], None, torch.bfloat16), Linear)


@needs_native
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "I8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [True, False])
def test_group_kernels_below_is_where_the_product_leaves_them(
    name: str, dtype: torch.dtype, amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``group_kernels_below`` (the fused decode step stops below it: native_decode.py) is the
    first row count whose product is not the quantized group kernels, on this CPU and on one
    without AMX (the AMX, int8 or dense product, as the crossovers give them), and says so
    without building anything."""
    from asyncengine.kernels.cpu import quant_amx_native
    from asyncengine.kernels.quant_formats import FORMATS
    from tests.kernels.test_quantized_kernels import random_weight

    if not amx:
        monkeypatch.setattr(quant_amx_native, "available", lambda: False)
    weight = random_weight(FORMATS[name], 32, 512, seed=7)
    projection = QuantizedLinear([weight], dense_from_rows=dense_from_rows([weight], dtype))
    below = projection.group_kernels_below(dtype)
    assert projection._dense is None and projection._i8 is None
    assert all(
        projection._product(n, dtype) == projection._quantized for n in range(1, min(below, 300))
    )
    if below < 300:  # the float32 crossovers of the block formats lie past any step
        assert projection._product(below, dtype) != projection._quantized


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_of_the_group_kernels_are_their_float32_sums(dtype: torch.dtype) -> None:
    """``float32_out`` below every crossover (the group kernels): each part's float32 sums of
    the same q8 activations, whether the projection has one part or several, never a bfloat16
    output widened."""
    from asyncengine.kernels.cpu import quant_native
    from asyncengine.kernels.quant_formats import FORMATS
    from tests.kernels.test_quantized_kernels import random_weight

    q4 = random_weight(FORMATS["Q4_K"], 32, 512, seed=8)
    q6 = random_weight(FORMATS["Q6_K"], 16, 512, seed=9)
    bias = torch.randn(48)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    one = QuantizedLinear([q4], bias[:32], dense_from_rows=8)
    both = QuantizedLinear([q4, q6], bias, dense_from_rows=8)
    assert one._product(2, dtype) == one._quantized and both._product(2, dtype) == both._quantized
    wide = [
        quant_native.quant_linear(x, part, b, out_dtype=torch.float32)
        for part, b in zip(both.parts, bias.split([32, 16]), strict=True)
    ]
    assert torch.equal(one.float32_out(x), wide[0])
    logits = both.float32_out(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, torch.cat(wide, dim=1))
    assert torch.equal(logits.to(dtype), both(x))
