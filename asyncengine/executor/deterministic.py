"""Deterministic mode (``EngineConfig.deterministic``, ``--deterministic``): a request's greedy
output does not depend on the batch it runs in.

Where batch dependence comes from, measured on a CPU in bfloat16 (float32 hides most of it: its
rounding differences rarely flip a token):
- matmuls: the GEMM kernel is chosen by shape, and a different kernel sums a row in a
  different order (executor/layers/linear.py: fixed-shape row blocks for dense weights; a
  quantized projection keeps one product at every row count, the int8 one for the K formats
  and Q8_0 where the CPU runs it, else the group kernels, both batch invariant);
- attention: the decode kernel sums in another order than the extend kernel, and torch's fused
  attention picks its key block from the call's key length, which padding to the longest
  request, chunked prefill and prefix-cache hits change. On a CPU with the native extend kernel
  every query goes through it (invariant_native_attention.py); elsewhere torch's attention runs
  with keys padded to fixed blocks (invariant_attention.py).
Norms, rotary, activations and the greedy sampler work row by row on the CPU: nothing to do.

Nor does the thread count change a row: every CPU kernel of the mode shares its work among
threads by output rows, columns or (request, head, query block) items, never by cutting a sum,
so the CPU runner chooses one thread or all for each step as the default mode does
(executor/cpu/step_threads.py: on busy cores a fixed two-thread team spins at every barrier for
a descheduled thread). oneDNN picks its own split from the shape and the thread count, so the
runner checks each dense product shape at start-up (``products_match_on_one_thread``) and keeps
one count where one differs. tests/executor/test_deterministic_threads.py compares whole
forwards' logits on one thread and on two.

The mode swaps parts of the runner only: the attention backend, the matmuls' row blocks and (on
CUDA) the norms. The scheduler is untouched: batching, mixed batches, chunking, prefix caching
and retraction all stay on.

On a GPU the same design applies: the torch attention
backend with keys padded to fixed blocks (CUDA's fused attention reduces each query row in
key-block order, with no split across the batch), fixed-shape row blocks for cuBLAS, and the
norms on fixed-shape row blocks too (a CUDA reduction's launch shape follows the row count).
CUDA graphs and the Triton kernels are off in this mode; batch-invariant Triton kernels (fixed
split-KV size in decode attention, no split-K in matmuls) would be the fast path there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from asyncengine.executor.attention.invariant import InvariantTorchBackend
from asyncengine.executor.attention.invariant_native import NativeInvariantBackend
from asyncengine.executor.attention.selector import KernelOps, kernel_ops
from asyncengine.executor.attention.torch_backend import AttentionBackend
from asyncengine.executor.layers.linear import ROW_BLOCK, Linear
from asyncengine.kernels.cpu.attention_native import plan_native_extend

if TYPE_CHECKING:
    from asyncengine.executor.layers.model import LlamaModel


@dataclass(frozen=True, slots=True)
class ForwardParts:
    """What the runner builds the model from."""

    backend: AttentionBackend
    ops: KernelOps
    row_block: int | None = None  # None: one call per matmul


def deterministic_parts(
    device: torch.device,
    num_heads: int,
    k_cache: torch.Tensor,
    page_size: int,
) -> ForwardParts:
    """The batch-invariant parts for a pool whose layer-0 keys are ``k_cache``: the native
    extend kernel where it runs (an AVX-512 CPU), the padded torch attention elsewhere."""
    ops = kernel_ops("torch", device)
    if _native_extend_runs(num_heads, k_cache, page_size):
        return ForwardParts(NativeInvariantBackend(), ops, ROW_BLOCK)
    if device.type == "cuda":
        ops = replace(
            ops,
            rms_norm=_row_blocked(ops.rms_norm),
            fused_add_rms_norm=_row_blocked_pair(ops.fused_add_rms_norm),
        )
    return ForwardParts(InvariantTorchBackend(), ops, ROW_BLOCK)


def products_match_on_one_thread(model: LlamaModel, threads: int) -> bool:
    """Whether each shape of the model's dense products (oneDNN's, on a row block) gives the same
    bits on one thread as on ``threads``. A GEMM library picks its split from the shape and the
    thread count and may cut K across threads where rows and columns are too few to share out:
    then a step's count would change its bits, and the runner keeps one count. The quantized
    products are the native kernels, which share out output rows only (not checked here: on a
    1B Q4_K_M model their check took ~0.8 s of start-up)."""
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    seen: set[tuple[int, int]] = set()
    try:
        for linear in model.linears():
            if not isinstance(linear, Linear):
                continue
            weight = linear.packed if linear.packed is not None else linear.weight
            assert weight is not None
            shape = (int(weight.shape[0]), int(weight.shape[1]))
            if shape in seen:
                continue
            seen.add(shape)
            x = torch.randn(ROW_BLOCK, shape[1], generator=gen).to(model.dtype)
            results = []
            for count in (1, threads):
                torch.set_num_threads(count)
                with torch.inference_mode():
                    results.append(linear(x))
            if not torch.equal(results[0], results[1]):
                return False
    finally:
        torch.set_num_threads(before)
    return True


def _native_extend_runs(num_heads: int, k_cache: torch.Tensor, page_size: int) -> bool:
    if k_cache.device.type != "cpu":
        return False
    one = torch.ones(1, dtype=torch.int32)
    table, cu = torch.zeros((1, 1), dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    return plan_native_extend(table, cu, one, page_size, num_heads, k_cache) is not None


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
