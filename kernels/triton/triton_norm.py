"""RMSNorm and fused residual-add + RMSNorm in Triton, one program per row.

Rounding follows the torch reference (and HF): normalize in float32, round to the input dtype,
then multiply by the weight; the fused variant rounds ``x + residual`` to the input dtype
before normalizing it, because that rounded sum is the residual stream the next layer sees.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.triton.triton_utils import check_device, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, 0) / hidden
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask
    )


def _num_warps(block: int) -> int:
    if block <= 1024:
        return 4
    if block <= 4096:
        return 8
    return 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match hidden {hidden}")
    x_rows = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out_rows = out.view(-1, hidden)
    residual_rows = _rows(residual) if residual is not None else x_rows
    summed = torch.empty_like(x) if residual is not None else None
    summed_rows = summed.view(-1, hidden) if summed is not None else out_rows
    if x_rows.shape[0] == 0:
        return out, summed
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows,
        residual_rows,
        weight,
        out_rows,
        summed_rows,
        x_rows.stride(0),
        residual_rows.stride(0),
        out_rows.stride(0),
        summed_rows.stride(0),
        hidden,
        eps,
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * x / rms(x) over the last dimension, any leading shape."""
    check_device(x, weight)
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over the row."""
    check_device(x, residual, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape")
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed
