"""Linear on the CPU: once its weight is packed for oneDNN it keeps only the packed copy (one
copy of the weights resident, not two), and still computes x @ W.T + b for any leading shape.
A float32 model's projections become F32 rows (``make_linear``) where the native kernels are."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from asyncengine.executor import linear as linear_module
from asyncengine.executor.linear import (
    DENSE_FROM_ROWS_BY_FORMAT,
    Linear,
    QuantizedLinear,
    make_linear,
)
from asyncengine.kernels import cpu_native
from asyncengine.kernels.quant_formats import F32


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


@pytest.mark.skipif(not cpu_native.compiler_found(), reason="needs the native library")
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
