"""The FlashInfer attention backend (CUDA; ``attention_backend = "flashinfer"``).

FlashInfer's paged prefill and decode wrappers read our pool in place: a layer's cache
``[slots, Hkv, D]`` is ``[pages, page_size, Hkv, D]`` (FlashInfer's "NHD" layout) and our page
table rows are its page indices. Once per forward the batch becomes FlashInfer's CSR page
layout (``paged_kv_layout``); the first layer of each kind of attention (a window, a soft cap)
plans the wrappers, the others reuse the plan. K/V are stored by the Triton store kernel; norms,
rotary and the activation are the Triton kernels too (executor/attention/selector.py).

Kernels are JIT-compiled by FlashInfer with nvcc on first use (minutes; cached under
``~/.cache/flashinfer``). Both wrappers use FlashInfer's FA2 kernels, the decode one through its
tensor-core path by default, which shares the prefill kernel: one compile instead of two.
No CUDA graphs: the runner captures graphs for the Triton backend only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.executor.attention.torch_backend import PLAIN, AttentionBackend, AttentionOptions
from asyncengine.executor.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)


@dataclass(frozen=True, slots=True)
class PagedKVLayout:
    """FlashInfer's CSR view of block tables: request i's pages are
    ``indices[indptr[i]:indptr[i + 1]]`` and its last page holds ``last_page_len[i]`` tokens."""

    indptr: torch.Tensor  # [B + 1] int32
    indices: torch.Tensor  # [total pages] int32
    last_page_len: torch.Tensor  # [B] int32


def paged_kv_layout(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> PagedKVLayout:
    """Block tables [B, P] (page ids, rows possibly wider than needed) and KV lengths [B] (each
    >= 1) -> the CSR layout, on the tables' device."""
    pages = (seq_lens.to(torch.int32) + page_size - 1) // page_size
    indptr = torch.zeros(pages.shape[0] + 1, dtype=torch.int32, device=block_table.device)
    torch.cumsum(pages, 0, out=indptr[1:])
    width = torch.arange(block_table.shape[1], device=block_table.device)
    indices = block_table[width[None, :] < pages[:, None]].to(torch.int32)
    last_page_len = seq_lens.to(torch.int32) - (pages - 1) * page_size
    return PagedKVLayout(indptr, indices, last_page_len)


@dataclass(slots=True)
class FlashInferMetadata:
    slot_mapping: torch.Tensor
    page_size: int
    num_extend_tokens: int
    extend_cu_seqlens_q: torch.Tensor | None
    extend_layout: PagedKVLayout | None
    decode_layout: PagedKVLayout | None
    planned: set[tuple[AttentionOptions, float]] = field(default_factory=set)


@dataclass(slots=True)
class _Wrappers:
    prefill: Any  # flashinfer.BatchPrefillWithPagedKVCacheWrapper
    decode: Any  # flashinfer.BatchDecodeWithPagedKVCacheWrapper


class FlashInferBackend(AttentionBackend):
    """Paged extend and decode attention through FlashInfer's wrappers (see the module doc).

    ``decode_tensor_cores``: decode through FlashInfer's prefill (tensor-core) kernel, which
    the extend path compiles anyway; False: its CUDA-core decode kernel (a second compile).
    """

    def __init__(self, device: torch.device | str, decode_tensor_cores: bool = True) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.device = torch.device(device)
        self.decode_tensor_cores = decode_tensor_cores
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[tuple[AttentionOptions, float], _Wrappers] = {}

    def build_metadata(self, batch: ForwardBatch) -> FlashInferMetadata:
        has_extends = batch.num_extends > 0 and batch.num_extend_tokens > 0
        return FlashInferMetadata(
            slot_mapping=batch.slot_mapping,
            page_size=batch.page_size,
            num_extend_tokens=batch.num_extend_tokens,
            extend_cu_seqlens_q=batch.extend_cu_seqlens_q if has_extends else None,
            extend_layout=paged_kv_layout(
                batch.extend_block_table, batch.extend_seq_lens, batch.page_size
            )
            if has_extends
            else None,
            decode_layout=paged_kv_layout(
                batch.decode_block_table, batch.decode_seq_lens, batch.page_size
            )
            if batch.num_decodes
            else None,
        )

    def _planned(
        self,
        m: FlashInferMetadata,
        options: AttentionOptions,
        scale: float,
        q: torch.Tensor,
        k_cache: torch.Tensor,
    ) -> _Wrappers:
        key = (options, scale)
        wrappers = self._wrappers.get(key)
        if wrappers is None:
            fi = self._flashinfer
            wrappers = _Wrappers(
                prefill=fi.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, "NHD", backend="fa2"
                ),
                decode=fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    "NHD",
                    use_tensor_cores=self.decode_tensor_cores,
                    backend="fa2",
                ),
            )
            self._wrappers[key] = wrappers
        if key in m.planned:
            return wrappers
        heads, kv_heads, head_dim = q.shape[1], k_cache.shape[1], k_cache.shape[2]
        common: dict[str, Any] = {
            "window_left": options.window - 1 if options.window else -1,
            "logits_soft_cap": options.softcap or None,
            "sm_scale": scale,
            "q_data_type": q.dtype,
            "kv_data_type": k_cache.dtype,
        }
        if m.extend_layout is not None:
            layout = m.extend_layout
            wrappers.prefill.plan(
                m.extend_cu_seqlens_q,
                layout.indptr,
                layout.indices,
                layout.last_page_len,
                heads,
                kv_heads,
                head_dim,
                m.page_size,
                causal=True,
                **common,
            )
        if m.decode_layout is not None:
            layout = m.decode_layout
            wrappers.decode.plan(
                layout.indptr,
                layout.indices,
                layout.last_page_len,
                heads,
                kv_heads,
                head_dim,
                m.page_size,
                **common,
            )
        m.planned.add(key)
        return wrappers

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
        from asyncengine.kernels.triton.triton_kv_store import store_kv

        assert isinstance(metadata, FlashInferMetadata)
        m = metadata
        store_kv(k_cache, v_cache, k, v, m.slot_mapping)
        return self.attend(q, k_cache, v_cache, m, scale, options)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        assert isinstance(metadata, FlashInferMetadata)
        m = metadata
        wrappers = self._planned(m, options, scale, q, k_cache)
        kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        paged = (
            k_cache.view(-1, m.page_size, kv_heads, head_dim),
            v_cache.view(-1, m.page_size, kv_heads, head_dim),
        )
        out = torch.empty_like(q)
        n_ext = m.num_extend_tokens
        if m.extend_layout is not None:
            wrappers.prefill.run(q[:n_ext], paged, out=out[:n_ext])
        if m.decode_layout is not None:
            wrappers.decode.run(q[n_ext:], paged, out=out[n_ext:])
        return out
