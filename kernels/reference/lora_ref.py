"""Batched LoRA on the activations, the torch reference of kernels/cpu/cpu_lora.c and
kernels/triton/triton_lora.py: ``y[rows] += (x[rows] @ a.T) @ b.T`` for the rows that share one
adapter, summed in float32 (whatever the adapter's dtype) and added to y in its own dtype."""

from __future__ import annotations

import torch


def lora_apply_ref(
    y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> None:
    """In place on ``y`` [n, out]: ``x`` [n, in]; ``rows`` [k] int64 row indices; ``a`` [R, in]
    and ``b`` [out, R] (the scaling folded in)."""
    if rows.numel() == 0:
        return
    xs = x.index_select(0, rows).float()
    delta = (xs @ a.float().T) @ b.float().T
    y.index_add_(0, rows, delta.to(y.dtype))


def segments_of(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted row indices as (start, end) runs of consecutive rows."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs
