"""Paged attention references: decode (one query per request) and extend (ragged queries).

Both gather each request's keys/values by token slot into padded [B, L, Hkv * D] tensors (one
``index_select`` of whole token rows, the fastest gather on CPU) and attend under a mask.
Padding keys repeat the request's last real key, so every gathered value is finite (a slot never
written may hold anything, and 0 * NaN is NaN even where the mask zeroes the probability).

Decode is memory bound: with few KV heads it runs as one batched matmul per request over all KV
heads at once, each query head's vector placed in its own head's block of an otherwise zero
[H, Hkv * D] matrix (``BLOCK_DIAGONAL_MAX_KV_HEADS``); fewer, larger matmuls beat Hkv * B tiny
ones, and the zeros add exact zeros. With many KV heads the keys are regrouped per head instead.

Decode walks the batch in chunks of requests whose gathered K/V stay within a few MiB
(``DECODE_CHUNK_BYTES``): the gathered rows are then still in cache when the matmuls read them,
which more than pays for the extra calls (2x faster at batch 64, context 256, bfloat16).

The building blocks are public so that a backend can compute the layout once per forward and
reuse it in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK_DIAGONAL_MAX_KV_HEADS = 4
DECODE_CHUNK_BYTES = 4 << 20


def padded_kv_slots(
    block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int, page_size: int
) -> torch.Tensor:
    """[B, max_len] int64 pool slots of keys 0..seq_len-1, padded with the last key's slot."""
    positions = torch.arange(max_len, device=seq_lens.device).unsqueeze(0)
    positions = torch.minimum(positions, (seq_lens.long() - 1).unsqueeze(1))
    pages = block_table.long().gather(1, positions // page_size)
    return pages * page_size + positions % page_size


def decode_mask_bias(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, 1, max_len] float32: 0 where key j < seq_lens[b] is visible, -inf elsewhere."""
    keys = torch.arange(max_len, device=seq_lens.device).unsqueeze(0)
    hidden = keys >= seq_lens.long().unsqueeze(1)
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=seq_lens.device)
    return bias.masked_fill_(hidden, float("-inf")).unsqueeze(1)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, L, Hkv * D] of the slots [B, L]; ``out`` reuses buffers of that size."""
    num_slots = k_cache.shape[0]
    flat = kv_slots.reshape(-1)
    k_rows, v_rows = k_cache.view(num_slots, -1), v_cache.view(num_slots, -1)
    shape = (*kv_slots.shape, k_rows.shape[1])
    if out is None:
        return k_rows.index_select(0, flat).view(shape), v_rows.index_select(0, flat).view(shape)
    k_out, v_out = out
    torch.index_select(k_rows, 0, flat, out=k_out.view(-1, shape[-1]))
    torch.index_select(v_rows, 0, flat, out=v_out.view(-1, shape[-1]))
    return k_out.view(shape), v_out.view(shape)


def decode_chunk_size(max_len: int, k_cache: torch.Tensor) -> int:
    """Requests per decode chunk: their gathered K and V together fill ~DECODE_CHUNK_BYTES."""
    token_bytes = 2 * k_cache[0].numel() * k_cache.element_size()
    return max(1, DECODE_CHUNK_BYTES // (max_len * token_bytes))


def decode_gather_buffers(
    k_cache: torch.Tensor, kv_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reusable K and V gather buffers [chunk, L, Hkv * D] for decode over kv_slots [B, L]."""
    batch, max_len = kv_slots.shape
    shape = (min(batch, decode_chunk_size(max_len, k_cache)), max_len, k_cache[0].numel())
    return (
        torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
        torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
    )


def decode_attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    mask_bias: torch.Tensor,
    scale: float,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode q [B, H, D] over the pool slots kv_slots [B, L], chunk by chunk -> [B, H, D]."""
    if buffers is None:
        buffers = decode_gather_buffers(k_cache, kv_slots)
    k_buf, v_buf = buffers
    chunk = k_buf.shape[0]
    batch = q.shape[0]
    if batch <= chunk:
        k, v = gather_kv(k_cache, v_cache, kv_slots, (k_buf[:batch], v_buf[:batch]))
        return decode_attention_gathered(q, k, v, mask_bias, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for start in range(0, batch, chunk):
        end = min(start + chunk, batch)
        n = end - start
        k, v = gather_kv(k_cache, v_cache, kv_slots[start:end], (k_buf[:n], v_buf[:n]))
        out[start:end] = decode_attention_gathered(q[start:end], k, v, mask_bias[start:end], scale)
    return out


def decode_attention_gathered(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, D] against gathered k/v [B, L, Hkv * D] under mask_bias [B, 1, L] -> [B, H, D].

    Scores and softmax in float32, probabilities rounded to q's dtype for the value matmul.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-1] // head_dim
    group = num_heads // num_kv_heads
    if num_kv_heads > BLOCK_DIAGONAL_MAX_KV_HEADS:
        return _decode_per_kv_head(q, k, v, mask_bias, scale)
    # q_blocks[b, h, j] = q[b, h] if j is h's KV head else 0: [B, H, Hkv * D]
    own_head = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device)
    own_head = own_head.repeat_interleave(group, dim=0)  # [H, Hkv]
    q_blocks = (q.unsqueeze(2) * own_head[None, :, :, None]).view(batch, num_heads, -1)
    scores = torch.bmm(q_blocks, k.transpose(1, 2))  # [B, H, L]
    probs = torch.softmax(torch.add(mask_bias, scores, alpha=scale), dim=-1).to(q.dtype)
    out = torch.bmm(probs, v).view(batch, num_kv_heads, group, num_kv_heads, head_dim)
    # keep each query head's own KV-head block: the diagonal of (kv head of q, kv head of v)
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(batch, num_heads, head_dim)


def _decode_per_kv_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_bias: torch.Tensor, scale: float
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-1] // head_dim
    group = num_heads // num_kv_heads
    length = k.shape[1]
    q_grouped = q.view(batch, num_kv_heads, group, head_dim)
    k_heads = k.view(batch, length, num_kv_heads, head_dim).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v_heads = v.view(batch, length, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, L, D]
    scores = torch.matmul(q_grouped, k_heads)  # [B, Hkv, G, L]
    probs = torch.softmax(torch.add(mask_bias.unsqueeze(1), scores, alpha=scale), dim=-1)
    return torch.matmul(probs.to(q.dtype), v_heads).view(batch, num_heads, head_dim)


@dataclass(slots=True)
class ExtendLayout:
    """Where each ragged query sits in the padded [B, max_q_len] grid, and the causal mask."""

    batch_index: torch.Tensor  # [N] int64
    query_index: torch.Tensor  # [N] int64
    mask: torch.Tensor  # [B, 1, max_q_len, max_len] bool
    max_q_len: int


def extend_layout(
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_q_len: int, max_len: int
) -> ExtendLayout:
    """Query i of request b sits at position seq_lens[b] - q_len[b] + i and sees keys 0..there.

    Padding queries (i >= q_len) see keys up to a position past the end; they are never read.
    """
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    num_tokens = int(cu[-1])
    batch_index = torch.repeat_interleave(torch.arange(len(q_lens), device=cu.device), q_lens)
    query_index = torch.arange(num_tokens, device=cu.device) - cu[:-1].index_select(0, batch_index)
    first_pos = seq_lens.long() - q_lens  # position of each request's first query
    query_pos = first_pos[:, None] + torch.arange(max_q_len, device=cu.device)[None, :]
    keys = torch.arange(max_len, device=cu.device)
    mask = keys[None, None, :] <= query_pos[:, :, None]
    return ExtendLayout(batch_index, query_index, mask[:, None], max_q_len)


def extend_attention_gathered(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: ExtendLayout,
    scale: float,
) -> torch.Tensor:
    """Ragged q [N, H, D] against gathered k/v [B, L, Hkv * D] -> [N, H, D]."""
    batch, length = k.shape[:2]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[-1] // head_dim
    single = batch == 1 and layout.max_q_len == q.shape[0]
    if single:  # one request: its queries are the padded grid already
        q_pad = q.unsqueeze(0)
    else:
        q_pad = q.new_zeros(batch, layout.max_q_len, num_heads, head_dim)
        q_pad[layout.batch_index, layout.query_index] = q
    # a lone prefill from position 0 is plain causal attention: no mask to build or read
    from_zero = single and layout.max_q_len == length
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        k.view(batch, length, num_kv_heads, head_dim).transpose(1, 2),
        v.view(batch, length, num_kv_heads, head_dim).transpose(1, 2),
        attn_mask=None if from_zero else layout.mask,
        is_causal=from_zero,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)
    return out[0] if single else out[layout.batch_index, layout.query_index]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D]; block_table [B, P] int32; seq_lens [B] int32 incl. the new token -> [B, H, D]."""
    max_len = int(seq_lens.max())
    kv_slots = padded_kv_slots(block_table, seq_lens, max_len, page_size)
    mask_bias = decode_mask_bias(seq_lens, max_len)
    return decode_attention_paged(q, k_cache, v_cache, kv_slots, mask_bias, scale)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D] ragged by cu_seqlens_q [B+1]; seq_lens [B] total kv length -> [N, H, D]."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    max_len = int(seq_lens.max())
    layout = extend_layout(cu_seqlens_q, seq_lens, int(q_lens.max()), max_len)
    k, v = gather_kv(k_cache, v_cache, padded_kv_slots(block_table, seq_lens, max_len, page_size))
    return extend_attention_gathered(q, k, v, layout, scale)
