"""Attention backends: the interface the model calls in each layer, and the torch (CPU) backend.

A forward's tokens come in two groups, extends first and decodes after, so that one long
prefill does not pad many one-token decodes. A backend turns the ``ForwardBatch`` into its own
metadata once per forward (``build_metadata``); every layer then calls ``forward`` with it.
Which backend runs where is chosen in executor/attention/selector.py. A layer's own attention options
(Gemma 2/3: sliding window, soft-capping) come with each call as an ``AttentionOptions``; the
metadata stays shared by every layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.kernels.attention_grouping import ExtendCost
from asyncengine.kernels.cpu.attention_native import (
    NativeDecodePlan,
    NativeExtendPlan,
    native_decode_attention,
    native_extend_attention,
    plan_native_decode,
    plan_native_extend,
)
from asyncengine.kernels.reference.attention_ref import (
    DecodePlan,
    ExtendPlan,
    decode_attention_planned,
    extend_attention_planned,
    plan_decode,
    plan_extend,
)
from asyncengine.kernels.reference.kv_store_ref import store_kv


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """One layer's attention beyond causal softmax(q k^T scale) v.

    ``window``: keys a query sees, itself included (position p sees p - window + 1 .. p);
    0: every earlier key. ``softcap``: scaled scores s become softcap * tanh(s / softcap)
    before masking and softmax; 0: off.
    """

    window: int = 0
    softcap: float = 0.0

    @property
    def plain(self) -> bool:
        return not (self.window or self.softcap)


PLAIN = AttentionOptions()


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
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        """q [N, H, D], k/v [N, Hkv, D]; caches [S, Hkv, D] of this layer -> [N, H, D]."""

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        """Attention of q [N, H, D] over K/V already in the caches (the model stored them)."""
        raise NotImplementedError(f"{type(self).__name__} stores and attends in forward()")


@dataclass(slots=True)
class BatchMetadata:
    """Metadata that keeps the forward's batch (its slot mapping says where K/V go)."""

    batch: ForwardBatch


class StoreThenAttendBackend(AttentionBackend):
    """A backend that reads every key from the pool: ``forward`` stores the layer's new K/V at
    the batch's slots, then ``attend``s. Its metadata is a ``BatchMetadata``."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        assert isinstance(metadata, BatchMetadata)
        store_kv(k_cache, v_cache, k, v, metadata.batch.slot_mapping)
        return self.attend(q, k_cache, v_cache, metadata, scale, options)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        """Attention of q [N, H, D] over K/V already in the caches."""


@dataclass(slots=True)
class TorchAttentionMetadata(BatchMetadata):
    """The forward's batch and the plans of its extends and decodes: the first layer makes
    them (they need the pool's heads and dtype), every other layer reuses them."""

    extend_plan: ExtendPlan | NativeExtendPlan | None = None
    decode_plan: DecodePlan | NativeDecodePlan | None = None


class TorchBackend(StoreThenAttendBackend):
    """On a CPU, extends and decodes through the native kernels (kernels/cpu/cpu_*_attention.c: keys
    and values read in place from the pool); elsewhere (or without a C compiler) extends in
    buckets of similar lengths and decodes in place from the pool for float32 or in gathered
    chunks (attention_ref). ``native=False`` keeps the torch paths on a CPU too.
    ``extend_cost`` prices the buckets; None: the default for the model's heads (an
    ``ExtendCost`` with an infinite ``call`` keeps one bucket).
    """

    def __init__(self, extend_cost: ExtendCost | None = None, native: bool = True) -> None:
        self.extend_cost = extend_cost
        self.native = native  # False: the torch paths even where the native kernels run

    def build_metadata(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(batch)

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
        m = metadata
        batch = m.batch
        if not batch.num_extends:
            return self._decode(q, k_cache, v_cache, m, scale, options)
        n_ext = batch.num_extend_tokens
        if m.extend_plan is None:
            args = (
                batch.extend_block_table,
                batch.extend_cu_seqlens_q,
                batch.extend_seq_lens,
                batch.page_size,
                q.shape[1],
                k_cache,
            )
            native = plan_native_extend(*args) if self.native else None
            m.extend_plan = native or plan_extend(*args, self.extend_cost)
        window, softcap = options.window, options.softcap
        if isinstance(m.extend_plan, NativeExtendPlan):
            out = native_extend_attention(
                q[:n_ext], k_cache, v_cache, m.extend_plan, scale, window, softcap
            )
        else:
            out = extend_attention_planned(
                q[:n_ext], k_cache, v_cache, m.extend_plan, scale, window, softcap
            )
        if not batch.num_decodes:
            return out
        return torch.cat([out, self._decode(q[n_ext:], k_cache, v_cache, m, scale, options)])

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        m: TorchAttentionMetadata,
        scale: float,
        options: AttentionOptions,
    ) -> torch.Tensor:
        if m.decode_plan is None:
            batch = m.batch
            args = (batch.decode_block_table, batch.decode_seq_lens, batch.page_size, q.shape[1])
            native = plan_native_decode(*args, k_cache) if self.native else None
            m.decode_plan = native or plan_decode(*args, k_cache)
        window, softcap = options.window, options.softcap
        if isinstance(m.decode_plan, NativeDecodePlan):
            return native_decode_attention(
                q, k_cache, v_cache, m.decode_plan, scale, window, softcap
            )
        return decode_attention_planned(q, k_cache, v_cache, m.decode_plan, scale, window, softcap)
