"""The Triton attention backend: the executor's GPU path (CPU only under TRITON_INTERPRET=1).

Per layer: one KV-store launch, one extend launch over the extend tokens, one decode launch
(plus its split merge) over the decode tokens, both writing into one output tensor. Everything
that does not change between layers (the longest extend, the decode split count) is fixed once
per forward, so no layer reads a value back from the device. The split count needs the number
of KV heads, which the batch does not carry: the first layer computes it from its cache.

The pool is in the model's dtype or int8 (kv_cache_dtype = int8): the store kernels quantize
each head's row with its scale beside it (kernels/reference/kv_int8_ref.py's layout and
rounding), the attention kernels take each key's scale on its dot products and each value's on
its softmax weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.executor.attention.torch_backend import PLAIN, AttentionBackend, AttentionOptions
from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.kernels.reference.kv_int8_ref import cache_head_dim
from asyncengine.kernels.triton.triton_decode_attention import (
    CONTEXT_BUCKETS,
    choose_num_splits,
    decode_attention,
)
from asyncengine.kernels.triton.triton_extend_attention import Q_LEN_BUCKETS, extend_attention
from asyncengine.kernels.triton.triton_kv_store import store_kv
from asyncengine.kernels.triton.triton_utils import length_bucket


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64
    page_size: int
    num_extend_tokens: int
    extend_block_table: torch.Tensor | None  # [Be, Pe] int32
    extend_cu_seqlens_q: torch.Tensor | None  # [Be + 1] int32
    extend_seq_lens: torch.Tensor | None  # [Be] int32
    extend_max_q_len: int
    decode_block_table: torch.Tensor | None  # [Bd, Pd] int32
    decode_seq_lens: torch.Tensor | None  # [Bd] int32
    decode_num_splits: int | None = None  # set by the first layer's forward


@dataclass(frozen=True, slots=True)
class WarmUpRun:
    kernel: str  # "decode" or "extend"
    key: tuple[int, bool]  # (length bucket, direct) for decode; (length bucket, False) for extend
    batch: int
    length: int  # decode: every request's context; extend: the new tokens of one request


class TritonBackend(AttentionBackend):
    """Paged extend and decode attention in Triton kernels (kernels/triton/triton_*.py)."""

    def warm_up(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        page_size: int,
        max_batch_size: int,
        max_context: int,
        dtype: torch.dtype | None = None,
    ) -> list[WarmUpRun]:
        """Run each attention kernel once per autotuning key a server can reach, with queries
        of ``dtype`` (the model's; default: the pool's).

        Autotuning benchmarks every config the first time a key is seen; without this the
        first requests of each length class pay it (seconds on a fresh process). Reads pool
        pages, writes none. Returns the runs made, one per key.
        """
        num_kv_heads, head_dim = k_cache.shape[1], cache_head_dim(k_cache)
        num_pages = max(k_cache.shape[0] // page_size, 1)
        device, dtype = k_cache.device, dtype or k_cache.dtype
        scale = head_dim**-0.5
        lengths = sorted(
            {min(n, max_context) for n in (page_size, 256, *CONTEXT_BUCKETS, *Q_LEN_BUCKETS)}
            | {max_context}
        )
        runs: list[WarmUpRun] = []
        seen: set[tuple[str, tuple[int, bool]]] = set()

        def table(batch: int, length: int) -> torch.Tensor:
            width = -(-length // page_size)
            pages = torch.arange(width, dtype=torch.int32, device=device) % num_pages
            return pages.expand(batch, width).contiguous()

        for length in lengths:
            for batch in sorted({1, max_batch_size}):
                splits = choose_num_splits(batch, num_kv_heads, length, device)
                key = (
                    length_bucket(-(-length // page_size) * page_size, CONTEXT_BUCKETS),
                    splits == 1,
                )
                if ("decode", key) in seen:
                    continue
                seen.add(("decode", key))
                q = torch.randn((batch, num_heads, head_dim), device=device, dtype=dtype)
                seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
                decode_attention(
                    q, k_cache, v_cache, table(batch, length), seq_lens, page_size, scale,
                    num_splits=splits,
                )  # fmt: skip
                runs.append(WarmUpRun("decode", key, batch, length))
            key = (length_bucket(length, Q_LEN_BUCKETS), False)
            if ("extend", key) in seen:
                continue
            seen.add(("extend", key))
            q = torch.randn((length, num_heads, head_dim), device=device, dtype=dtype)
            cu = torch.tensor([0, length], dtype=torch.int32, device=device)
            seq_lens = torch.tensor([length], dtype=torch.int32, device=device)
            extend_attention(
                q, k_cache, v_cache, table(1, length), cu, seq_lens, page_size, scale,
                max_q_len=length,
            )  # fmt: skip
            runs.append(WarmUpRun("extend", key, 1, length))
        return runs

    def build_metadata(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        has_extends = batch.num_extends > 0 and batch.num_extend_tokens > 0
        has_decodes = batch.num_decodes > 0
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            page_size=batch.page_size,
            num_extend_tokens=batch.num_extend_tokens,
            extend_block_table=batch.extend_block_table if has_extends else None,
            extend_cu_seqlens_q=batch.extend_cu_seqlens_q if has_extends else None,
            extend_seq_lens=batch.extend_seq_lens if has_extends else None,
            extend_max_q_len=batch.extend_max_q_len,
            decode_block_table=batch.decode_block_table if has_decodes else None,
            decode_seq_lens=batch.decode_seq_lens if has_decodes else None,
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
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        assert isinstance(metadata, TritonAttentionMetadata)
        store_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        return self.attend(q, k_cache, v_cache, metadata, scale, options)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        """Attention of q over K/V already in the caches (stored by the model's fused rotary +
        KV store: kernels/triton/triton_rotary_store.py)."""
        assert isinstance(metadata, TritonAttentionMetadata)
        m = metadata
        out = torch.empty_like(q)
        n_ext = m.num_extend_tokens
        if m.extend_block_table is not None:
            assert m.extend_cu_seqlens_q is not None and m.extend_seq_lens is not None
            extend_attention(
                q[:n_ext],
                k_cache,
                v_cache,
                m.extend_block_table,
                m.extend_cu_seqlens_q,
                m.extend_seq_lens,
                m.page_size,
                scale,
                max_q_len=m.extend_max_q_len,
                out=out[:n_ext],
                window=options.window,
                softcap=options.softcap,
            )
        if m.decode_block_table is not None:
            assert m.decode_seq_lens is not None
            if m.decode_num_splits is None:
                m.decode_num_splits = choose_num_splits(
                    m.decode_seq_lens.shape[0],
                    k_cache.shape[1],
                    m.decode_block_table.shape[1] * m.page_size,
                    q.device,
                )
            decode_attention(
                q[n_ext:],
                k_cache,
                v_cache,
                m.decode_block_table,
                m.decode_seq_lens,
                m.page_size,
                scale,
                num_splits=m.decode_num_splits,
                out=out[n_ext:],
                window=options.window,
                softcap=options.softcap,
            )
        return out
