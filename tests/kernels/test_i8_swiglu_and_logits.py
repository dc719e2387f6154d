"""The int8 product's two fused entries (kernels/cpu/cpu_quant_i8gemm.c) and where the engine takes
them (executor/layers/linear.py, model.py): ``silu_linear`` multiplies SwiGLU's rows as it makes
them (the same values as layer_ops_native.silu_and_mul's, so the same bits as the product of
its output), and ``linear`` writes float32 from bfloat16 activations (the LM head's logits: the
sums the bfloat16 output rounds)."""

from __future__ import annotations

import re

import pytest
import torch

from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.kernels.cpu import layer_ops_native, quant_i8gemm_native, quant_native
from asyncengine.kernels.quant_formats import FORMATS
from asyncengine.kernels.reference import activation_ref, i8gemm_ref
from tests.kernels.test_quant_i8gemm import needs_fast
from tests.kernels.test_quantized_kernels import product_scale, random_weight
from tests.native_support import needs_native

pytestmark = [
    needs_native,
    pytest.mark.skipif(
        not layer_ops_native.available(), reason="the native layer kernels are not available"
    ),
    pytest.mark.usefixtures("without_amx"),  # the int8 product's paths where AMX would take them
]


def _other_builds() -> list[str]:
    """The builds beside the native one (the scalar kernel on the same layout)."""
    return ["avx2"] if quant_i8gemm_native.available() else ["avx2", "scalar"]


def _gate_up(n: int, inter: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2 * inter, generator=gen) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_swiglu_rows_give_the_product_of_the_native_swiglu(name: str, dtype: torch.dtype) -> None:
    """Bit for bit, around the 4-row tiles and past the 256-row blocks, with and without bias,
    into a column slice of a wider output; Q8_0 also over rows of a partial last super-block
    (Gemma 3 1B's 1152: the rows made, then padded with zeros)."""
    widths = ((256, 24), (768, 40), *([(1152, 24)] if name == "Q8_0" else []))
    for inter, rows in widths:
        weight = random_weight(FORMATS[name], rows, inter, seed=inter + rows)
        panels = quant_i8gemm_native.pack(weight)
        for n in (1, 5, 33, 300):
            gate_up = _gate_up(n, inter, dtype, seed=n)
            bias = torch.randn(rows) if n % 2 else None
            expected = quant_i8gemm_native.linear(
                layer_ops_native.silu_and_mul(gate_up), panels, bias
            )
            assert torch.equal(quant_i8gemm_native.silu_linear(gate_up, panels, bias), expected)
        wide = torch.full((n, rows + 9), 7.0, dtype=dtype)
        quant_i8gemm_native.silu_linear(gate_up, panels, bias, out=wide[:, 4 : 4 + rows])
        assert torch.equal(wide[:, 4 : 4 + rows], expected)
        assert bool((wide[:, :4] == 7).all()) and bool((wide[:, 4 + rows :] == 7).all())


@pytest.mark.parametrize("isa", _other_builds())
def test_swiglu_rows_in_the_other_builds(isa: str) -> None:
    """The scalar kernel's builds make SwiGLU with libm's exp: within the activations' bfloat16
    rounding of the product of the reference SwiGLU."""
    weight = random_weight(FORMATS["Q4_K"], 40, 512, seed=5)
    panels = quant_i8gemm_native.pack(weight)
    gate_up = _gate_up(9, 512, torch.bfloat16, seed=9)
    act = activation_ref.silu_and_mul(gate_up.float()).to(torch.bfloat16).float()
    ref = i8gemm_ref.linear(act, weight, None)
    y = quant_i8gemm_native.silu_linear(gate_up.float(), panels, isa=isa)
    torch.testing.assert_close(
        y.double(), ref, rtol=0, atol=2**-7 * product_scale(act, weight, None)
    )


@pytest.mark.parametrize("isa", ["native", *_other_builds()])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_float32_out_is_what_the_bfloat16_out_rounds(isa: str, name: str) -> None:
    weight = random_weight(FORMATS[name], 40, 512, seed=11)
    panels = quant_i8gemm_native.pack(weight)
    bias = torch.randn(40)
    for n in (1, 6, 35):
        x = torch.randn(n, 512).to(torch.bfloat16)
        wide = quant_i8gemm_native.linear(x, panels, bias, isa=isa, out_dtype=torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(
            wide.to(torch.bfloat16), quant_i8gemm_native.linear(x, panels, bias, isa=isa)
        )
        ref = i8gemm_ref.linear(x.float(), weight, bias)
        atol = 1e-5 * product_scale(x.float(), weight, bias)
        torch.testing.assert_close(wide.double(), ref, rtol=0, atol=atol)


def test_what_the_entries_refuse() -> None:
    panels = quant_i8gemm_native.pack(random_weight(FORMATS["Q4_K"], 16, 256, seed=1))
    with pytest.raises(ValueError, match=re.escape("gate | up")):
        quant_i8gemm_native.silu_linear(torch.randn(2, 256), panels)
    with pytest.raises(ValueError, match="float32"):
        quant_i8gemm_native.linear(torch.randn(2, 256), panels, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="float32"):  # a float32 x writes float32 only
        quant_i8gemm_native.linear(torch.randn(2, 256), panels, out_dtype=torch.bfloat16)


@needs_fast
def test_the_engine_takes_them_where_it_takes_the_int8_product() -> None:
    """A projection on the int8 product multiplies SwiGLU's rows itself and writes float32
    logits; below its dense crossover (the group kernels) both are the unfused calls, bit for
    bit."""
    down = QuantizedLinear([random_weight(FORMATS["Q6_K"], 48, 512, seed=3)], dense_from_rows=8)
    made: list[int] = []  # the rows SwiGLU was made for apart from the product

    def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
        made.append(gate_up.shape[0])
        return layer_ops_native.silu_and_mul(gate_up)

    for n in (3, 8, 40):
        gate_up = _gate_up(n, 512, torch.bfloat16, seed=n)
        unfused = down(layer_ops_native.silu_and_mul(gate_up))
        assert torch.equal(down.silu_and_mul_product(gate_up, swiglu), unfused)
        x = torch.randn(n, 512).to(torch.bfloat16)
        logits = down.float32_out(x)
        assert logits.dtype == torch.float32
        assert torch.equal(logits.to(torch.bfloat16), down(x))
        if n < 8:  # the group kernels' float32 sums
            wide = quant_native.quant_linear(x, down.parts[0], down.bias, out_dtype=torch.float32)
            assert torch.equal(logits, wide)
    assert made == [3]
    assert down._i8 is not None and down._dense is None
