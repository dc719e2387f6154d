"""Deterministic mode (``EngineConfig.deterministic``, ``--deterministic``): a request's greedy
output does not depend on the batch it runs in.

Where batch dependence comes from, measured on this machine in bfloat16 (float32 hides most of
it: its rounding differences rarely flip a token):
- matmuls: the GEMM kernel is chosen by shape, and a different kernel sums a row in a
  different order (invariant_linear.py);
- attention: the fused kernel's key block follows the call's key length, which padding to the
  longest request of a group changes; so do chunked prefill and prefix-cache hits
  (invariant_attention.py).
Norms, rotary, activations and the greedy sampler work row by row on the CPU: nothing to do.

The mode swaps three parts of the runner, nothing else: the attention backend, the matmul
function of the model, and (on CUDA) the norms. The scheduler is untouched: batching, mixed
batches, chunking, prefix caching and retraction all stay on.

On a GPU the same design applies, but it is not measured (no GPU here): the torch attention
backend with keys padded to fixed blocks (CUDA's fused attention reduces each query row in
key-block order, with no split across the batch), fixed-shape row blocks for cuBLAS, and the
norms on fixed-shape row blocks too (a CUDA reduction's launch shape follows the row count).
CUDA graphs and the Triton kernels are off in this mode; batch-invariant Triton kernels (fixed
split-KV size in decode attention, no split-K in matmuls) would be the fast path there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from asyncengine.executor.attention import AttentionBackend
from asyncengine.executor.backends import KernelOps, kernel_ops
from asyncengine.executor.invariant_attention import InvariantTorchBackend
from asyncengine.executor.invariant_linear import ROW_BLOCK, fixed_block_linear

Linear = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class ForwardParts:
    """What the runner builds the model from."""

    backend: AttentionBackend
    ops: KernelOps
    linear: Linear = F.linear


def deterministic_parts(device: torch.device) -> ForwardParts:
    ops = kernel_ops("torch")
    if device.type == "cuda":
        ops = replace(
            ops,
            rms_norm=_row_blocked(ops.rms_norm),
            fused_add_rms_norm=_row_blocked_pair(ops.fused_add_rms_norm),
        )
    return ForwardParts(InvariantTorchBackend(), ops, fixed_block_linear)


def _padded_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    rows = x.shape[0]
    padded = x.new_zeros((-(-rows // ROW_BLOCK) * ROW_BLOCK, *x.shape[1:]))
    padded[:rows] = x
    return list(padded.split(ROW_BLOCK))


def _row_blocked(norm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def blocked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.cat([norm(block, weight, eps) for block in _padded_blocks(x)])
        return out[: x.shape[0]]

    return blocked


def _row_blocked_pair(
    norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def blocked(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [
            norm(xb, rb, weight, eps)
            for xb, rb in zip(_padded_blocks(x), _padded_blocks(residual), strict=True)
        ]
        rows = x.shape[0]
        return torch.cat([p[0] for p in pairs])[:rows], torch.cat([p[1] for p in pairs])[:rows]

    return blocked
