"""The torch twin of the int8 product (kernels/cpu/cpu_quant_i8gemm.c), for tests.

    q, d = quantize_q8_k(x)        # x [n, k] -> int8 per 256 values, one float32 scale each
    y = linear(x, weight, bias)    # x's int8 form (dequantized) @ weight (dequantized).T, float64

The activations take one scale per 256 values against the K formats, per 32 against the 32-value
block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: ``scale_block``).

The kernel's integer sums are exact and its weights are the format's own values, so it differs
from ``linear`` by float32 rounding only; ``rounding_bound`` is how far the activations' rounding
alone can move each output from the exact product x @ W.T.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.quant_formats import QuantizedTensor
from asyncengine.kernels.reference import quant_ref

SUPER_BLOCK = 256
BLOCK32_FORMATS = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"})


def scale_block(weight: QuantizedTensor) -> int:
    """The activation values that share one scale against this weight's format."""
    return 32 if weight.format.name in BLOCK32_FORMATS else SUPER_BLOCK


def quantize_q8_k(x: torch.Tensor, block: int = SUPER_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, k] (k a multiple of block) -> q int8 [n, k], d float32 [n, k / block]: d = max|x| / 127
    per block of values, q = round-half-even(x * 127 / max|x|), as the C kernel does."""
    n, k = x.shape
    blocks = x.float().reshape(n, k // block, block)
    amax = blocks.abs().amax(dim=-1)
    # a true division (``127.0 / amax`` is 127 * reciprocal(amax): a last bit off, and the
    # ties of bfloat16 activations round the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int8)
    return q.reshape(n, k), amax / 127.0


def dequantized_activations(x: torch.Tensor, block: int = SUPER_BLOCK) -> torch.Tensor:
    """float64 [n, k]: the values x's int8 form stands for."""
    q, d = quantize_q8_k(x, block)
    n, k = x.shape
    blocks = q.double().reshape(n, k // block, block) * d.double().unsqueeze(-1)
    return blocks.reshape(n, k)


def linear(
    x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 [n, rows]: x's int8 form @ the dequantized weight.T (+ bias)."""
    out = dequantized_activations(x, scale_block(weight)) @ quant_ref.dequantize(weight).double().T
    return out if bias is None else out + bias.double()


def rounding_bound(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """float64 [n, rows]: sum_k |W[r, k]| d(k) / 2, the most that rounding x to its int8 form
    (each value off by at most half its block's scale d) can move each output."""
    block = scale_block(weight)
    _, d = quantize_q8_k(x, block)
    step = d.double().repeat_interleave(block, dim=1) / 2
    return step @ quant_ref.dequantize(weight).abs().double().T
