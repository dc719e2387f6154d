"""Attention backends: the interface the model calls in each layer, and the torch (CPU) backend.

A forward's tokens come in two groups, extends first and decodes after, so that one long
prefill does not pad many one-token decodes. A backend turns the ``ForwardBatch`` into its own
metadata once per forward (``build_metadata``); every layer then calls ``forward`` with it.
Backends are created by name from ``ATTENTION_BACKENDS`` (``register_backend`` adds one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncengine.executor.forward_batch import ForwardBatch
from kernels.attention_ref import (
    ExtendLayout,
    decode_attention_paged,
    decode_gather_buffers,
    decode_mask_bias,
    extend_attention_gathered,
    extend_layout,
    gather_kv,
    padded_kv_slots,
)
from kernels.kv_store_ref import store_kv


class AttentionBackend(ABC):
    """Stores a layer's new K/V into the pool, then attends over prefix + new tokens."""

    @abstractmethod
    def build_metadata(self, batch: ForwardBatch) -> object:
        """Everything the layers share in this forward (index tensors, masks, ...)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        """q [N, H, D], k/v [N, Hkv, D]; caches [S, Hkv, D] of this layer -> [N, H, D]."""


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_extend_tokens: int
    extend_kv_slots: torch.Tensor | None  # [Be, Le]
    extend_layout: ExtendLayout | None
    decode_kv_slots: torch.Tensor | None  # [Bd, Ld]
    decode_mask_bias: torch.Tensor | None  # [Bd, 1, Ld] float32
    # gather buffers, made by the first layer and reused by the others (no per-layer allocation)
    extend_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    decode_buffers: tuple[torch.Tensor, torch.Tensor] | None = None


class TorchBackend(AttentionBackend):
    """Gather-by-slot into padded tensors, then batched attention per group (attention_ref)."""

    def build_metadata(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        extend_slots = layout = decode_slots = mask_bias = None
        if batch.num_extends:
            extend_slots = padded_kv_slots(
                batch.extend_block_table,
                batch.extend_seq_lens,
                batch.extend_max_seq_len,
                batch.page_size,
            )
            layout = extend_layout(
                batch.extend_cu_seqlens_q,
                batch.extend_seq_lens,
                batch.extend_max_q_len,
                batch.extend_max_seq_len,
            )
        if batch.num_decodes:
            decode_slots = padded_kv_slots(
                batch.decode_block_table,
                batch.decode_seq_lens,
                batch.decode_max_seq_len,
                batch.page_size,
            )
            mask_bias = decode_mask_bias(batch.decode_seq_lens, batch.decode_max_seq_len)
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_extend_tokens=batch.num_extend_tokens,
            extend_kv_slots=extend_slots,
            extend_layout=layout,
            decode_kv_slots=decode_slots,
            decode_mask_bias=mask_bias,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata)
        m = metadata
        store_kv(k_cache, v_cache, k, v, m.slot_mapping)
        n_ext = m.num_extend_tokens
        if m.extend_kv_slots is None:
            return self._decode(q, k_cache, v_cache, m, scale)
        assert m.extend_layout is not None
        if m.extend_buffers is None:
            m.extend_buffers = _gather_buffers(k_cache, m.extend_kv_slots)
        k_ext, v_ext = gather_kv(k_cache, v_cache, m.extend_kv_slots, m.extend_buffers)
        out = extend_attention_gathered(q[:n_ext], k_ext, v_ext, m.extend_layout, scale)
        if m.decode_kv_slots is None:
            return out
        return torch.cat([out, self._decode(q[n_ext:], k_cache, v_cache, m, scale)])

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        m: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert m.decode_kv_slots is not None and m.decode_mask_bias is not None
        if m.decode_buffers is None:
            m.decode_buffers = decode_gather_buffers(k_cache, m.decode_kv_slots)
        return decode_attention_paged(
            q, k_cache, v_cache, m.decode_kv_slots, m.decode_mask_bias, scale, m.decode_buffers
        )


def _gather_buffers(
    cache: torch.Tensor, kv_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*kv_slots.shape, cache[0].numel())
    return (
        torch.empty(shape, dtype=cache.dtype, device=cache.device),
        torch.empty(shape, dtype=cache.dtype, device=cache.device),
    )


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": TorchBackend}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    ATTENTION_BACKENDS[name] = factory


def create_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}: expected one of {', '.join(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]()
