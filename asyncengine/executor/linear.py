"""Linear: ``y = x @ weight.T + bias``, with the weight prepacked once for oneDNN on the CPU.

torch's ``F.linear`` on a CPU hands oneDNN a plain [out, in] weight, which it re-lays out into
its blocked format on every call; prepacking (``mkldnn._reorder_linear_weight``) does that once
at load time, and ``mkldnn._linear_pointwise`` multiplies by the packed weight: the same sums in
the same order (bit-identical outputs in bfloat16), 10-20% less time at decode batch sizes and
half at batch 1 on an AVX-512 BF16 CPU (scripts/bench_forward.py). Elsewhere (CUDA, other
dtypes, a torch build without those ops) it is ``F.linear``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows; any count works
ENABLE_ENV = "ASYNCENGINE_PACKED_LINEAR"  # "0": plain F.linear (to measure what packing gives)


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
    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.packed = _pack(weight)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)
