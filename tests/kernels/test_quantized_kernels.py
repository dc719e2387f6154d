"""The quantized matmul kernels (kernels/cpu/cpu_quant_matmul.c) against the torch reference
(kernels/reference/quant_ref.py), for every format, odd shapes, and every ISA path this CPU can run
(AVX512-VNNI where the CPU has it, AVX2, scalar).

Standalone, on any x86 machine (prints the ISA the native build picked):
    .venv/bin/python -m tests.kernels.test_quantized_kernels
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.quant_formats import (
    BF16,
    F32,
    FLOAT_FORMATS,
    FORMATS,
    I8,
    QuantFormat,
    QuantizedTensor,
    bf16_rows,
    cat_rows,
    f32_rows,
)
from asyncengine.kernels.reference import quant_ref
from tests.native_support import needs_native

# only a missing compiler skips: a kernel that fails to build with one fails these tests
pytestmark = needs_native


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _isas() -> list[str]:
    isas = ["native", "scalar"]
    if {"avx2", "fma", "f16c"} <= _cpu_flags():
        isas.append("avx2")
    return isas


ISAS = _isas()
# offsets of the fp16 scale fields inside one block (random bytes elsewhere are valid values)
FP16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_weight(fmt: QuantFormat, rows: int, cols: int, seed: int) -> QuantizedTensor:
    """Random blocks: every byte random, the scales set to small finite fp16 values."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == I8:
        return quant_ref.quantize_i8(torch.randn(rows, cols, generator=gen))
    if fmt == F32:
        return f32_rows(torch.randn(rows, cols, generator=gen) * 0.1)
    if fmt == BF16:
        return bf16_rows((torch.randn(rows, cols, generator=gen) * 0.1).to(torch.bfloat16))
    blocks = cols // fmt.block_size
    data = torch.randint(0, 256, (rows, blocks, fmt.block_bytes), dtype=torch.uint8, generator=gen)
    for offset in FP16_FIELDS[fmt.name]:
        scale = (torch.rand(rows, blocks, generator=gen) * 0.02 - 0.005).to(torch.float16)
        data[:, :, offset : offset + 2] = scale.view(torch.uint8).reshape(rows, blocks, 2)
    return QuantizedTensor(fmt, data.reshape(rows, -1).contiguous(), cols)


def product_scale(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> float:
    """The magnitude of the terms a product sums (|x| |W|^T + |bias|, its largest): float32
    rounding is relative to it, not to the result, which a lone dot product can cancel to near
    zero (one row, one activation row: the result's own size made the tolerance ~1e-8)."""
    terms = x.abs().double() @ quant_ref.dequantize(weight).abs().double().T
    if bias is not None:
        terms = terms + bias.abs().double()
    return float(terms.max()) + 1e-6


def _cols(fmt: QuantFormat) -> list[int]:
    if fmt in FLOAT_FORMATS:  # any width: whole vectors of 8 (16), and a scalar tail
        return [1, 13, 40, 547]
    return [256, 768] if fmt.block_size == 256 else [32, 96, 544]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_matmul_matches_the_reference(name: str, isa: str) -> None:
    fmt = FORMATS[name]
    for cols in _cols(fmt):
        for rows, n in ((1, 1), (7, 3), (33, 4), (100, 5), (17, 9)):
            weight = random_weight(fmt, rows, cols, seed=rows * 31 + n + cols)
            x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n + cols))
            bias = torch.randn(rows) if rows % 2 else None
            ref = quant_ref.quant_matmul(x, weight, bias)
            scale = product_scale(x, weight, bias)
            for y in (
                quant_native.quant_matmul(x, weight, bias, isa=isa),
                quant_native.quant_linear(x, weight, bias, isa=isa),
            ):
                torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "BF16"])
def test_float32_out_is_what_the_bfloat16_out_rounds(name: str, isa: str) -> None:
    """bfloat16 rows into float32 sums (the LM head's logits): the sums as they are, which the
    bfloat16 output rounds; a float32 x writes float32 only."""
    fmt = FORMATS[name]
    cols = _cols(fmt)[0]
    weight = random_weight(fmt, 40, cols, seed=17)
    bias = torch.randn(40)
    for n in (1, 3):
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        wide = quant_native.quant_linear(x, weight, bias, isa=isa, out_dtype=torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(
            wide.to(torch.bfloat16), quant_native.quant_linear(x, weight, bias, isa=isa)
        )
        ref = quant_ref.quant_matmul(x.float(), weight, bias)
        scale = product_scale(x.float(), weight, bias)
        torch.testing.assert_close(wide, ref, rtol=2e-5, atol=2e-5 * scale)
    with pytest.raises(ValueError, match="float32"):
        quant_native.quant_linear(torch.randn(1, cols), weight, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
def test_quantized_activations_are_the_reference_bit_for_bit(isa: str) -> None:
    x = torch.randn(5, 96) * 3
    x[1] = 0.0  # an all-zero row: scale 0, values 0
    q, d, sd = quant_native.quantize_q8(x, isa)
    q_ref, d_ref, sd_ref = quant_ref.quantize_q8(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    torch.testing.assert_close(sd, sd_ref, rtol=1e-6, atol=0)
    assert int(q.abs().max()) == 127 and not q[1].any()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_rows_matches_gguf(name: str, isa: str) -> None:
    fmt = FORMATS[name]
    weight = random_weight(fmt, 9, _cols(fmt)[-1], seed=3)
    full = quant_ref.dequantize(weight)
    rows = torch.tensor([8, 0, 3, 3])
    torch.testing.assert_close(
        quant_native.dequantize_rows(weight, rows, isa=isa), full[rows], rtol=1e-6, atol=1e-7
    )
    torch.testing.assert_close(quant_native.dequantize_rows(weight, None, isa=isa), full)
    as_bf16 = quant_native.dequantize_rows(weight, rows, torch.bfloat16, isa=isa)
    assert torch.equal(as_bf16, full[rows].to(torch.bfloat16))


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_activations_and_output(isa: str) -> None:
    weight = random_weight(FORMATS["Q4_1"], 40, 96, seed=1)
    x = torch.randn(3, 96).to(torch.bfloat16)
    y = quant_native.quant_matmul(x, weight, isa=isa)
    assert y.dtype == torch.bfloat16
    ref = quant_ref.quant_matmul(x.float(), weight)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("isa", ISAS)
def test_f32_rows_are_the_float32_product_and_refuse_q8_activations(isa: str) -> None:
    """F32 weights meet the float32 activations themselves (no q8 rounding): the product is
    torch's float32 matmul up to summation order, and q8 blocks or bf16 inputs are refused."""
    w = torch.randn(300, 224) * 0.05
    x = torch.randn(6, 224)
    bias = torch.randn(300)
    y = quant_native.quant_linear(x, f32_rows(w), bias, isa=isa)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    out = torch.empty(6, 300)
    with pytest.raises(ValueError, match="F32"):
        quant_native.matmul_quantized(quant_native.quantize_q8(x), f32_rows(w), out)
    with pytest.raises(ValueError, match="F32"):
        quant_native.quant_linear(x.to(torch.bfloat16), f32_rows(w), isa=isa)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rows_are_the_float32_product_of_the_stored_values(isa: str) -> None:
    """BF16 weights are widened to float32 as read (exact): the product of float32 activations is
    torch's float32 matmul of the widened weight up to summation order; bfloat16 activations are
    widened too and the result rounded once to bfloat16; each row's sums are the same alone, in
    a batch and paired with the next weight row (batch invariant); q8 blocks are refused."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(301, 227, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(7, 227, generator=gen)
    bias = torch.randn(301, generator=gen)
    y = quant_native.quant_linear(x, bf16_rows(w), bias, isa=isa)
    want = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    torch.testing.assert_close(y, want.float(), rtol=1e-5, atol=1e-5)
    for i in range(7):  # one row alone: the same bits as in the batch of 7
        assert torch.equal(
            quant_native.quant_linear(x[i : i + 1], bf16_rows(w), bias, isa=isa), y[i : i + 1]
        )
    assert torch.equal(
        quant_native.quant_linear(x, bf16_rows(w[1:2]), bias[1:2], isa=isa), y[:, 1:2]
    )
    half = quant_native.quant_linear(x.to(torch.bfloat16), bf16_rows(w), bias, isa=isa)
    assert half.dtype == torch.bfloat16
    widened = torch.nn.functional.linear(x.to(torch.bfloat16).double(), w.double(), bias.double())
    assert torch.equal(
        half,
        quant_native.quant_linear(x.to(torch.bfloat16).float(), bf16_rows(w), bias, isa=isa).to(
            torch.bfloat16
        ),
    )
    torch.testing.assert_close(half.float(), widened.float(), rtol=2**-8, atol=1e-5)
    out = torch.empty(7, 301)
    with pytest.raises(ValueError, match="BF16"):
        q8 = quant_native.quantize_q8(x[:, :224].contiguous())
        quant_native.matmul_quantized(q8, bf16_rows(w[:, :224].contiguous()), out)
    with pytest.raises(ValueError, match="BF16"):
        quant_native.quant_linear(x.half(), bf16_rows(w), isa=isa)


def test_output_into_a_column_slice_of_a_wider_tensor() -> None:
    a = random_weight(FORMATS["Q4_K"], 10, 256, seed=1)
    b = random_weight(FORMATS["Q6_K"], 6, 256, seed=2)
    x = torch.randn(2, 256)
    act = quant_native.quantize_q8(x)
    out = torch.full((2, 16), float("nan"))
    quant_native.matmul_quantized(act, a, out[:, :10])
    quant_native.matmul_quantized(act, b, out[:, 10:])
    ref = torch.cat([quant_ref.quant_matmul(x, a), quant_ref.quant_matmul(x, b)], dim=1)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()))


def test_rows_concatenate_and_reorder_as_bytes() -> None:
    a = random_weight(FORMATS["Q4_1"], 4, 64, seed=1)
    b = random_weight(FORMATS["Q4_1"], 3, 64, seed=2)
    fused = cat_rows([a, b])
    assert isinstance(fused, QuantizedTensor) and fused.shape == (7, 64)
    expected = torch.cat([quant_ref.dequantize(a), quant_ref.dequantize(b)])
    assert torch.equal(quant_ref.dequantize(fused), expected)
    order = torch.tensor([6, 0, 2])
    assert torch.equal(quant_ref.dequantize(fused.select_rows(order)), expected[order])
    with pytest.raises(ValueError, match="different formats"):
        cat_rows([a, random_weight(FORMATS["Q8_0"], 2, 64, seed=3)])


def test_int8_quantization_is_per_row_symmetric() -> None:
    w = torch.randn(5, 64)
    w[2] *= 100  # a row's scale does not touch the others
    q = quant_ref.quantize_i8(w)
    back = quant_ref.dequantize(q)
    per_row_step = w.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((back - w).abs() <= per_row_step / 2 + 1e-6).all())


def test_bad_shapes_are_refused() -> None:
    weight = random_weight(FORMATS["Q8_0"], 4, 64, seed=1)
    with pytest.raises(ValueError, match="blocks of 32"):
        quant_native.quant_matmul(torch.randn(2, 48), weight)
    with pytest.raises(ValueError, match="64 columns"):
        quant_native.quant_matmul(torch.randn(2, 96), weight)
    with pytest.raises(ValueError, match="take"):
        QuantizedTensor(FORMATS["Q8_0"], torch.zeros(2, 33, dtype=torch.uint8), 32)


if __name__ == "__main__":
    print(f"native quantized kernels: {quant_native.isa_name()} (tested paths: {', '.join(ISAS)})")
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
