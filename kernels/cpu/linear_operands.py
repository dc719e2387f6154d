"""The checks and output of a native ``y = x @ W.T (+ bias)`` over float activations, shared by
the products that take fp32/bf16 rows directly (quant_amx_native, quant_i8gemm_native)."""

from __future__ import annotations

import torch


def linear_operands(
    x: torch.Tensor,
    rows: int,
    cols: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` made contiguous and the [n, rows] output (``out``, or a new tensor of x's dtype or
    ``out_dtype``: x's or float32), or a ValueError naming what a kernel could not read or write
    safely."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        raise ValueError(f"activations must be 2-D CPU fp32/bf16, not {x.dtype} {x.device}")
    if x.shape[1] != cols:
        raise ValueError(f"activation rows of {x.shape[1]} values against {cols} columns")
    if bias is not None and (
        bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != rows
    ):
        raise ValueError("bias must be a contiguous float32 vector, one value an output")
    dtype = x.dtype if out_dtype is None else out_dtype
    if dtype not in (x.dtype, torch.float32):
        raise ValueError(f"the output is in x's dtype or float32, not {dtype}")
    x = x.contiguous()
    n = x.shape[0]
    if out is None:
        out = torch.empty((n, rows), dtype=dtype)
    if out.dtype != dtype or out.shape != (n, rows) or out.stride(1) != 1:
        raise ValueError(f"out must be [n, rows] in {dtype} with unit column stride")
    return x, out
