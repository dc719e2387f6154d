"""SiLU-and-mul (SwiGLU) in Triton: ``x [N, 2I] = gate | up -> silu(gate) * up [N, I]``.

As in the reference, ``silu(gate)`` is rounded to x's dtype before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.triton.triton_utils import check_device, next_power_of_2

MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    intermediate,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < intermediate
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + offs, mask=mask, other=0.0)
    silu = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
    out = silu * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for any leading shape."""
    check_device(x)
    width = x.shape[-1]
    if width % 2 != 0:
        raise ValueError(f"last dimension {width} is not gate | up (it must be even)")
    intermediate = width // 2
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], intermediate), dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, intermediate)
    if rows.shape[0] == 0:
        return out
    block = min(next_power_of_2(intermediate), MAX_BLOCK)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(intermediate, block))](
        rows, out_rows, rows.stride(0), out_rows.stride(0), intermediate, BLOCK=block, num_warps=4
    )
    return out
