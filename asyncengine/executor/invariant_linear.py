"""Batch-invariant matmuls: every product runs on row blocks of one fixed shape.

A GEMM library picks its kernel (blocking, K-splitting, a GEMV path for one row) from the
shape, so the same row can be summed in a different order when more rows share the call: on
this machine oneDNN's bfloat16 kernel for the 576x1536 down projection changes its order
between 6 and 7 rows, and MKL's float32 GEMV (1 row) differs from its GEMM. Within one shape
the order is the same for every row, whatever the other rows hold (tests/test_deterministic.py
checks both facts). So deterministic mode pads the rows to a multiple of ``ROW_BLOCK`` and
multiplies ``ROW_BLOCK`` rows at a time: a request's row meets the same kernel alone as in a
batch of 200.

The price is the padding (a lone decode computes ``ROW_BLOCK`` rows) and more, smaller calls
for long prefills; scripts/bench_deterministic.py measures it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_BLOCK = 32


def fixed_block_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K], computed ``ROW_BLOCK`` rows per call."""
    rows = x.shape[0]
    padded = -(-rows // ROW_BLOCK) * ROW_BLOCK
    if padded == ROW_BLOCK:
        if rows == ROW_BLOCK:
            return F.linear(x, weight, bias)
        block = x.new_zeros((ROW_BLOCK, x.shape[1]))
        block[:rows] = x
        return F.linear(block, weight, bias)[:rows]
    source = x.new_zeros((padded, x.shape[1]))
    source[:rows] = x
    out = x.new_empty((padded, weight.shape[0]))
    for start in range(0, padded, ROW_BLOCK):
        out[start : start + ROW_BLOCK] = F.linear(source[start : start + ROW_BLOCK], weight, bias)
    return out[:rows]
