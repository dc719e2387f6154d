"""Batched LoRA in Triton (Punica's shrink/expand, segment-gathered): for the rows of one
adapter, gathered by index from the batch, ``t = x[rows] @ a.T`` (shrink to the rank, float32),
then ``y[rows] += t @ b.T`` (expand, added in place). One launch pair per adapter in the step;
rows of different adapters never share a program, and a row appears once per call, so the
in-place add has no race. The torch reference is kernels/reference/lora_ref.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.triton.triton_utils import check_device, next_power_of_2

BLOCK_K = 64  # input features per step of the shrink
BLOCK_OUT = 64  # output features per program of the expand


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    rows_ptr,
    a_ptr,
    t_ptr,
    stride_x,
    in_features,
    rank,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_features
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + offs_r[:, None] * in_features + offs_k[None, :],
            mask=mask_r[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(t_ptr + i * rank + offs_r, acc, mask=mask_r)


@triton.jit
def _lora_expand_kernel(
    t_ptr,
    rows_ptr,
    b_ptr,
    y_ptr,
    stride_y,
    out_features,
    rank,
    BLOCK_R: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    i = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_o = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    mask_o = offs_o < out_features
    t = tl.load(t_ptr + i * rank + offs_r, mask=mask_r, other=0.0)
    b = tl.load(
        b_ptr + offs_o[:, None] * rank + offs_r[None, :],
        mask=mask_o[:, None] & mask_r[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * t[None, :], axis=1)
    y_at = y_ptr + row * stride_y + offs_o
    y = tl.load(y_at, mask=mask_o, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=mask_o)


def lora_apply(
    y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> None:
    """``y[rows] += (x[rows] @ a.T) @ b.T`` in place: ``x`` [n, in], ``y`` [n, out] (rows
    contiguous), ``rows`` [k] int64 distinct, ``a`` [R, in], ``b`` [out, R] contiguous."""
    check_device(y, x, rows, a, b)
    count = int(rows.shape[0])
    if count == 0:
        return
    rank, in_features = int(a.shape[0]), int(a.shape[1])
    out_features = int(b.shape[0])
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("LoRA rows must be contiguous along the features")
    a, b = a.contiguous(), b.contiguous()
    t = torch.empty((count, rank), dtype=torch.float32, device=x.device)
    block_r = max(16, next_power_of_2(rank))
    _lora_shrink_kernel[(count,)](
        x, rows, a, t, x.stride(0), in_features, rank, BLOCK_R=block_r, BLOCK_K=BLOCK_K
    )
    _lora_expand_kernel[(count, triton.cdiv(out_features, BLOCK_OUT))](
        t, rows, b, y, y.stride(0), out_features, rank, BLOCK_R=block_r, BLOCK_OUT=BLOCK_OUT
    )
