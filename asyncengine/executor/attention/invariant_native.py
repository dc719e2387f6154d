"""Batch-invariant attention on a CPU: every query of the forward, decodes too, through the native
extend kernel (kernels/cpu/cpu_extend_attention.c).

That kernel reduces each query row on its own: the row's keys are taken in blocks of 16 at
absolute positions 0, 16, 32, ... with the row's own running max and sum, and a row that shares
a tile with others only adds exact zeros for keys it does not see. So a row's output depends on
its query and its keys alone: not on the other requests of the forward, on how its prompt was
chunked, or on how much of it came from the prefix cache. Decodes go through the same kernel
(one-query extends) rather than the decode kernel, whose sums run in another order, so a token
recomputed in a prefill (a retracted request) equals the one its decode made. Sliding windows
and soft-capping (Gemma 2/3) are the kernel's own options and keep these properties.
tests/executor/test_deterministic.py checks these properties on the pool's layout.
"""

from __future__ import annotations

import torch

from asyncengine.executor.attention.torch_backend import (
    PLAIN,
    AttentionOptions,
    TorchAttentionMetadata,
    TorchBackend,
)
from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.kernels.cpu.attention_native import (
    NativeExtendPlan,
    native_extend_attention,
    plan_native_extend,
)


def _every_query_as_an_extend(
    batch: ForwardBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block table, cu_seqlens_q and seq_lens of the extends followed by the decodes."""
    ext, dec = batch.extend_block_table, batch.decode_block_table
    width = max(ext.shape[1], dec.shape[1])
    table = torch.zeros((ext.shape[0] + dec.shape[0], width), dtype=torch.int32)
    table[: ext.shape[0], : ext.shape[1]] = ext
    table[ext.shape[0] :, : dec.shape[1]] = dec
    cu = batch.extend_cu_seqlens_q.to(torch.int32)
    first = int(cu[-1]) if cu.numel() else 0
    decode_ends = first + torch.arange(1, batch.num_decodes + 1, dtype=torch.int32)
    cu = torch.cat([cu if cu.numel() else torch.zeros(1, dtype=torch.int32), decode_ends])
    seq_lens = torch.cat([batch.extend_seq_lens, batch.decode_seq_lens]).to(torch.int32)
    return table, cu, seq_lens


def plan_invariant_native(
    batch: ForwardBatch, num_heads: int, k_cache: torch.Tensor
) -> NativeExtendPlan | None:
    """The forward's plan, or None where the extend kernel does not run (no AVX-512 build,
    head dims other than 64, 128 and 256, not a CPU)."""
    if k_cache.device.type != "cpu":
        return None
    table, cu, seq_lens = _every_query_as_an_extend(batch)
    return plan_native_extend(table, cu, seq_lens, batch.page_size, num_heads, k_cache)


class NativeInvariantBackend(TorchBackend):
    """Deterministic mode's attention where the native extend kernel runs."""

    def __init__(self) -> None:
        super().__init__(native=True)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata)
        plan = metadata.extend_plan
        if plan is None:
            plan = plan_invariant_native(metadata.batch, q.shape[1], k_cache)
            if plan is None:
                raise RuntimeError("the native extend kernel does not run for this pool")
            metadata.extend_plan = plan
        assert isinstance(plan, NativeExtendPlan)
        return native_extend_attention(
            q, k_cache, v_cache, plan, scale, options.window, options.softcap
        )
