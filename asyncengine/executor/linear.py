"""Linear: ``y = x @ weight.T + bias``, with the weight prepacked once for oneDNN on the CPU.

torch's ``F.linear`` on a CPU hands oneDNN a plain [out, in] weight, which it re-lays out into
its blocked format on every call; prepacking (``mkldnn._reorder_linear_weight``) does that once
at load time, and ``mkldnn._linear_pointwise`` multiplies by the packed weight: the same sums in
the same order (bit-identical outputs in bfloat16), 10-20% less time at decode batch sizes and
half at batch 1 on an AVX-512 BF16 CPU (scripts/bench_forward.py). Elsewhere (CUDA, other
dtypes, a torch build without those ops) it is ``F.linear``.

Row blocks (deterministic mode): a GEMM library picks its kernel (blocking, K-splitting, a GEMV
path for one row) from the shape, so a row can be summed in a different order when more rows
share the call (on this machine oneDNN's bfloat16 kernel for the 576x1536 down projection
changes its order between 6 and 7 rows; MKL's float32 GEMV differs from its GEMM). Within one
shape the order is the same for every row, whatever the other rows hold
(tests/test_deterministic.py checks both facts). With ``row_block`` set, the rows are padded to
a multiple of it and multiplied ``row_block`` at a time: a request's row meets the same kernel
alone as in a batch of 200. The price is the padding (a lone decode computes ``row_block``
rows) and more, smaller calls for long prefills (scripts/bench_deterministic.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows; any count works
ENABLE_ENV = "ASYNCENGINE_PACKED_LINEAR"  # "0": plain F.linear (to measure what packing gives)
ROW_BLOCK = 32  # deterministic mode's row block (executor/deterministic.py)


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    return packed


class Linear:
    __slots__ = ("bias", "packed", "row_block", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, row_block: int | None = None
    ) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.packed = _pack(weight)
        self.row_block = row_block  # None: one call for all rows

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_block is None or x.dim() != 2:
            return self._multiply(x)
        return self._in_row_blocks(x, self.row_block)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)

    def _in_row_blocks(self, x: torch.Tensor, block: int) -> torch.Tensor:
        rows = x.shape[0]
        if rows == block:
            return self._multiply(x)
        padded = -(-rows // block) * block
        source = x.new_zeros((padded, x.shape[1]))
        source[:rows] = x
        if padded == block:
            return self._multiply(source)[:rows]
        out = x.new_empty((padded, self.out_features))
        for start in range(0, padded, block):
            out[start : start + block] = self._multiply(source[start : start + block])
        return out[:rows]
