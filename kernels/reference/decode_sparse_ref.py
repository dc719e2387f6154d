"""Float32 decode attention read straight from the paged pool: no gathered copy of K or V.

The pool's keys, viewed as rows of one KV head ([slots * Hkv, D]), are the columns of a sparse
pattern whose row (request b, query head h) lists b's keys of h's KV head. Scores are one
``torch.sparse.sampled_addmm`` (a dot product per listed key, read in place), the softmax runs
over a padded [n, H, L] view of them, and the output is one ``F.embedding_bag`` of the same
value rows weighted by the probabilities. The gather + fused attention path reads every key
too, but also writes and re-reads a copy: this one takes ~0.65x its time on a 1-thread AVX2
CPU, ~0.55x with 2 threads (30 layers of SmolLM2-135M's heads, batch 64, context 256, pages
shuffled), and ~0.6x the batched block-diagonal matmuls used before.

Both ops compute in the tensors' dtype, so this serves float32 only (bfloat16 would round the
scores); ``attention_ref`` picks it by dtype. Sliding windows and soft-capping
(attention_window.py) act on the scores before the softmax.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from asyncengine.kernels.attention_grouping import decode_chunks
from asyncengine.kernels.paged_kv import RowSelection, padded_kv_slots
from asyncengine.kernels.reference.attention_window import additive_mask, hidden_keys, soft_cap

# pattern entries (requests x query heads x keys) per chunk: bounds the index memory, 24 B each
SPARSE_DECODE_CHUNK_ENTRIES = 1 << 21


@dataclass(slots=True)
class SparseDecodeChunk:
    requests: RowSelection
    kv_len: int  # the chunk's longest request; the others are padded to it
    # CSR [n * H, slots * Hkv] listing each (request, head)'s key rows; every layer overwrites
    # its values with that layer's scores (sampled_addmm in place: no copy of the indices)
    pattern: torch.Tensor
    key_rows: torch.Tensor  # [n * H, kv_len] int64, the pattern's columns
    mask: torch.Tensor | None  # [n, 1, kv_len] float32 additive; None: every key visible
    lens: torch.Tensor  # [n] int64 keys of each request
    # by window: [n, 1, kv_len] float32 additive, made when a layer first asks
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int) -> torch.Tensor | None:
        if not window:
            return self.mask
        if window not in self.masks:
            hidden = hidden_keys((self.lens - 1)[:, None], self.kv_len, window)
            self.masks[window] = additive_mask(hidden, torch.float32)
        return self.masks[window]


@dataclass(slots=True)
class SparseDecodePlan:
    chunks: list[SparseDecodeChunk]


def plan_sparse_decode(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_slots: int,
) -> SparseDecodePlan:
    """Chunks of requests of similar lengths (longest first) for decode over seq_lens [B]."""
    device = seq_lens.device
    lens = seq_lens.tolist()
    kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    max_keys = max(1, SPARSE_DECODE_CHUNK_ENTRIES // num_heads)
    chunks = []
    for members in decode_chunks(lens, max_keys):
        requests = RowSelection.of(members, device)
        n, kv_len = len(members), lens[members[0]]
        chunk_lens = seq_lens[requests.positions]
        slots = padded_kv_slots(block_table[requests.positions], chunk_lens, kv_len, page_size)
        key_rows = (slots[:, None, :] * num_kv_heads + kv_head[None, :, None]).view(-1, kv_len)
        entries = key_rows.numel()
        with warnings.catch_warnings():  # "sparse CSR support is in beta state"
            warnings.simplefilter("ignore", UserWarning)
            pattern = torch.sparse_csr_tensor(
                torch.arange(0, entries + 1, kv_len, device=device),
                key_rows.view(-1),
                torch.zeros(entries, dtype=torch.float32, device=device),
                size=(n * num_heads, num_slots * num_kv_heads),
                check_invariants=False,
            )
        mask = None
        if any(lens[i] != kv_len for i in members):
            keys = torch.arange(kv_len, device=device)
            hidden = keys[None, :] >= chunk_lens.long()[:, None]
            mask = torch.zeros(hidden.shape, dtype=torch.float32, device=device)
            mask = mask.masked_fill_(hidden, float("-inf"))[:, None, :]
        chunks.append(
            SparseDecodeChunk(requests, kv_len, pattern, key_rows, mask, chunk_lens.long())
        )
    return SparseDecodePlan(chunks)


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SparseDecodePlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Decode q [B, H, D] (float32) over float32 caches [S, Hkv, D] as planned -> [B, H, D];
    ``window`` keys seen (0: all), scores soft-capped at ``softcap`` (0: off)."""
    num_heads, head_dim = q.shape[1:]
    key_rows = k_cache.view(-1, head_dim).t()  # [D, S * Hkv]: sampled_addmm's mat2, no copy
    value_rows = v_cache.view(-1, head_dim)
    in_order = len(plan.chunks) == 1 and plan.chunks[0].requests.index is None
    out = None if in_order else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for chunk in plan.chunks:
        n, kv_len = chunk.requests.count, chunk.kv_len
        q_rows = chunk.requests.take(q).reshape(n * num_heads, head_dim)
        torch.sparse.sampled_addmm(
            chunk.pattern, q_rows, key_rows, beta=0.0, alpha=scale, out=chunk.pattern
        )
        scores = chunk.pattern.values().view(n, num_heads, kv_len)
        if softcap:
            scores = soft_cap(scores, softcap)
        mask = chunk.mask_for(window)
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1).view(n * num_heads, kv_len)
        attended = F.embedding_bag(
            chunk.key_rows, value_rows, mode="sum", per_sample_weights=probs
        ).view(n, num_heads, head_dim)
        if out is None:
            return attended
        chunk.requests.put(out, attended)
    assert out is not None
    return out
