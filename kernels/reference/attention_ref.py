"""Paged attention references: decode (one query per request) and extend (ragged queries).

Extends gather each request's keys/values by token slot into padded [n, L, Hkv * D] tensors
(``paged_kv.gather_kv``) and run torch's fused ``scaled_dot_product_attention`` (scores, softmax
and accumulation in float32 for every input dtype) in buckets of similar lengths
(``attention_grouping.extend_buckets``): one call per bucket over its own padded [requests,
longest query, longest key] grid, causal without a mask where no request of the bucket has a
cached prefix.

Float32 decodes on CPU read keys and values in place from the pool (``decode_sparse_ref``).
Others gather chunks of requests of similar lengths whose K/V stay within a few MiB
(``DECODE_CHUNK_BYTES``, so the rows are still in cache when attention reads them) and run the
fused attention on them, a request's query heads as the queries of one row per KV head
([n, Hkv, group, D] against [n, Hkv, L, D]): keys are read once per KV head, not per query head.
On CPU the fused attention is also the only fast bfloat16 attention (~6x the batched matmuls).

The plans are built once per forward and reused by every layer (``plan_extend``,
``plan_decode``); ``extend_attention`` and ``decode_attention`` do both in one call.

A float16 pool (CPU: the engine's ``kv_cache_dtype``) is widened to the queries' dtype after
the gather (an int8 pool's rows dequantized: kv_int8_ref.py), and its masks are made in that dtype (``attention_dtype``): attention never computes
in float16 here.

Sliding-window and soft-capped layers (``window``, ``softcap``: attention_window.py) share the
plans: a plan makes each window's mask the first time a layer asks for it, and capped layers
run ``capped_attention`` on the same gathered keys instead of the fused attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncengine.kernels.attention_grouping import (
    ExtendCost,
    decode_chunks,
    extend_buckets,
    extend_cost_for,
)
from asyncengine.kernels.paged_kv import RowSelection, gather_buffers, gather_kv, padded_kv_slots
from asyncengine.kernels.reference.attention_window import (
    additive_mask,
    hidden_keys,
    window_attention,
)
from asyncengine.kernels.reference.decode_sparse_ref import (
    SparseDecodePlan,
    plan_sparse_decode,
    sparse_decode_attention,
)
from asyncengine.kernels.reference.kv_int8_ref import INT8, cache_head_dim, dequantize_flat

DECODE_CHUNK_BYTES = 4 << 20


def attention_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention over a pool of ``cache_dtype`` computes in (its masks' dtype):
    float32 for a float16 or int8 pool (whose queries are float32; a bfloat16 model's queries
    over an int8 pool read the same float32 masks of 0 and -inf), the pool's own otherwise."""
    return torch.float32 if cache_dtype in (torch.float16, INT8) else cache_dtype


def _widened(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered keys and values in the queries' dtype (a float16 pool's rows widened, an int8
    pool's dequantized)."""
    if k.dtype == INT8:
        head_dim = q.shape[-1]
        return dequantize_flat(k, head_dim, q.dtype), dequantize_flat(v, head_dim, q.dtype)
    if k.dtype == q.dtype:
        return k, v
    return k.to(q.dtype), v.to(q.dtype)


# ---------------------------------------------------------------------------- decode


@dataclass(slots=True)
class DecodeChunk:
    requests: RowSelection
    kv_len: int  # the chunk's longest request; the others are padded to it
    kv_slots: torch.Tensor  # [n, kv_len] int64
    # [n, 1, 1, kv_len] additive, in the pool's dtype (torch 2.13's CPU attention misreads a
    # float32 mask beside float64 queries); None: every key visible
    mask: torch.Tensor | None
    lens: torch.Tensor  # [n] int64 keys of each request
    # by window (0: causal only): [n, 1, 1, kv_len] additive, made when a layer first asks
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int, dtype: torch.dtype) -> torch.Tensor:
        if window not in self.masks:
            hidden = hidden_keys((self.lens - 1)[:, None], self.kv_len, window)
            self.masks[window] = additive_mask(hidden, dtype)[:, None]
        return self.masks[window]


@dataclass(slots=True)
class GatherDecodePlan:
    chunks: list[DecodeChunk]
    buffers: tuple[torch.Tensor, torch.Tensor]  # K, V rows for the largest chunk, reused


DecodePlan = GatherDecodePlan | SparseDecodePlan


def plan_decode(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_heads: int,
    k_cache: torch.Tensor,
) -> DecodePlan:
    """Plan decode over seq_lens [B] (incl. the new token) for the pool's layer caches like
    ``k_cache`` [S, Hkv, D]: in place from the pool for float32 on CPU (the only place it is
    measured and tested), gathered chunks otherwise."""
    if k_cache.dtype == torch.float32 and k_cache.device.type == "cpu":
        num_slots, num_kv_heads = k_cache.shape[:2]
        return plan_sparse_decode(
            block_table, seq_lens, page_size, num_heads, num_kv_heads, num_slots
        )
    return plan_gather_decode(block_table, seq_lens, page_size, k_cache)


def plan_gather_decode(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, k_cache: torch.Tensor
) -> GatherDecodePlan:
    device = seq_lens.device
    lens = seq_lens.tolist()
    token_bytes = 2 * k_cache[0].numel() * k_cache.element_size()  # K and V
    chunks = []
    for members in decode_chunks(lens, max(1, DECODE_CHUNK_BYTES // token_bytes)):
        requests = RowSelection.of(members, device)
        kv_len = lens[members[0]]  # longest first
        chunk_lens = seq_lens[requests.positions]
        kv_slots = padded_kv_slots(block_table[requests.positions], chunk_lens, kv_len, page_size)
        mask = None
        if any(lens[i] != kv_len for i in members):
            keys = torch.arange(kv_len, device=device)
            hidden = keys[None, :] >= chunk_lens.long()[:, None]
            mask = torch.zeros(hidden.shape, dtype=attention_dtype(k_cache.dtype), device=device)
            mask = mask.masked_fill_(hidden, float("-inf"))[:, None, None, :]
        chunks.append(DecodeChunk(requests, kv_len, kv_slots, mask, chunk_lens.long()))
    rows = max(c.requests.count * c.kv_len for c in chunks)
    return GatherDecodePlan(chunks, gather_buffers(k_cache, rows))


def decode_attention_planned(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Decode q [B, H, D] as planned -> [B, H, D]; ``window`` keys seen (0: all), scores
    soft-capped at ``softcap`` (0: off)."""
    if isinstance(plan, SparseDecodePlan):
        return sparse_decode_attention(q, k_cache, v_cache, plan, scale, window, softcap)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    in_order = len(plan.chunks) == 1 and plan.chunks[0].requests.index is None
    out = None if in_order else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for chunk in plan.chunks:
        n, length = chunk.requests.count, chunk.kv_len
        k, v = _widened(q, *gather_kv(k_cache, v_cache, chunk.kv_slots, plan.buffers))
        queries = chunk.requests.take(q).reshape(n, num_kv_heads, group, head_dim)
        keys = k.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        values = v.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        mask = (
            chunk.mask_for(window, attention_dtype(k_cache.dtype))
            if window or softcap
            else chunk.mask
        )
        attended = window_attention(queries, keys, values, mask, scale, softcap)
        attended = attended.reshape(n, num_heads, head_dim)
        if out is None:
            return attended
        chunk.requests.put(out, attended)
    assert out is not None
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [B, H, D]; block_table [B, P] int32; seq_lens [B] int32 incl. the new token -> [B, H, D]."""
    plan = plan_decode(block_table, seq_lens, page_size, q.shape[1], k_cache)
    return decode_attention_planned(q, k_cache, v_cache, plan, scale, window, softcap)


# ---------------------------------------------------------------------------- extend


@dataclass(slots=True)
class ExtendBucket:
    """Requests attended together over a padded [n, q_len, kv_len] grid: their queries are the
    ``n * q_len`` rows ``queries`` of q (padding repeats a request's last query), their keys
    rows ``kv_offset .. + n * kv_len`` of the plan's gather."""

    num_requests: int
    q_len: int
    kv_len: int
    queries: RowSelection
    kv_offset: int
    mask: torch.Tensor | None  # [n, 1, q_len, kv_len] additive, the pool's dtype; None: causal
    query_pos: torch.Tensor  # [n, q_len] int64 each query row's position
    # by window (0: causal only): explicit masks like ``mask``, made when a layer first asks
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int, dtype: torch.dtype) -> torch.Tensor:
        if window not in self.masks:
            hidden = hidden_keys(self.query_pos, self.kv_len, window)
            self.masks[window] = additive_mask(hidden, dtype)[:, None]
        return self.masks[window]


@dataclass(slots=True)
class ExtendPlan:
    buckets: list[ExtendBucket]
    kv_slots: torch.Tensor  # [R] int64: every bucket's padded key slots, bucket after bucket
    # [N] each token's row among the buckets' stacked padded outputs; None: already in order
    output_rows: torch.Tensor | None
    buffers: tuple[torch.Tensor, torch.Tensor]  # K, V [R, Hkv * D], reused by every layer


def plan_extend(
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_heads: int,
    k_cache: torch.Tensor,
    cost: ExtendCost | None = None,
) -> ExtendPlan:
    """Buckets for extend queries ragged by cu_seqlens_q [B+1] over seq_lens [B] keys each,
    for the pool's layer caches like ``k_cache`` [S, Hkv, D]. ``cost`` prices the buckets
    (default ``extend_cost_for`` the heads; an infinite ``call`` keeps one bucket)."""
    device = seq_lens.device
    num_kv_heads, head_dim = k_cache.shape[1], cache_head_dim(k_cache)
    if cost is None:
        cost = extend_cost_for(num_heads, num_kv_heads, head_dim)
    cu = cu_seqlens_q.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    kv_lens = seq_lens.tolist()
    buckets: list[ExtendBucket] = []
    slots: list[torch.Tensor] = []
    output_rows = torch.empty(cu[-1], dtype=torch.int64, device=device)
    kv_offset = out_offset = 0
    for members in extend_buckets(q_lens, kv_lens, cost):
        requests = RowSelection.of(members, device)
        n = len(members)
        q_len = max(q_lens[i] for i in members)
        kv_len = max(kv_lens[i] for i in members)
        bucket_kv_lens = seq_lens[requests.positions].long()
        bucket_slots = padded_kv_slots(
            block_table[requests.positions], bucket_kv_lens, kv_len, page_size
        )
        slots.append(bucket_slots.reshape(-1))
        starts = torch.tensor([cu[i] for i in members], dtype=torch.int64, device=device)
        bucket_q_lens = torch.tensor([q_lens[i] for i in members], device=device)
        steps = torch.arange(q_len, device=device)
        rows = starts[:, None] + torch.minimum(steps[None, :], bucket_q_lens[:, None] - 1)
        if requests.index is None and all(q_lens[i] == q_len for i in members):
            queries = RowSelection(cu[members[0]], n * q_len, None)
        else:
            queries = RowSelection(0, n * q_len, rows.reshape(-1))
        real = steps[None, :] < bucket_q_lens[:, None]
        padded_rows = out_offset + torch.arange(n * q_len, device=device).view(n, q_len)
        output_rows[rows[real]] = padded_rows[real]
        mask = None
        query_pos = (bucket_kv_lens - bucket_q_lens)[:, None] + steps[None, :]
        if any(q_lens[i] != kv_lens[i] for i in members):  # a cached prefix: not plain causal
            mask = additive_mask(hidden_keys(query_pos, kv_len, 0), attention_dtype(k_cache.dtype))[
                :, None
            ]
        buckets.append(ExtendBucket(n, q_len, kv_len, queries, kv_offset, mask, query_pos))
        kv_offset += n * kv_len
        out_offset += n * q_len
    in_order = out_offset == cu[-1] and torch.equal(
        output_rows, torch.arange(cu[-1], device=device)
    )
    return ExtendPlan(
        buckets,
        torch.cat(slots),
        None if in_order else output_rows,
        gather_buffers(k_cache, kv_offset),
    )


def extend_attention_planned(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Ragged q [N, H, D] bucket by bucket as planned -> [N, H, D]; ``window`` keys seen by
    each query (0: all up to itself), scores soft-capped at ``softcap`` (0: off)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    k_all, v_all = _widened(q, *gather_kv(k_cache, v_cache, plan.kv_slots, plan.buffers))
    outs = []
    for b in plan.buckets:
        n, q_len, kv_len = b.num_requests, b.q_len, b.kv_len
        rows = slice(b.kv_offset, b.kv_offset + n * kv_len)
        queries = b.queries.take(q).view(n, q_len, num_heads, head_dim).transpose(1, 2)
        keys = k_all[rows].view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)
        values = v_all[rows].view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)
        mask = b.mask_for(window, attention_dtype(k_cache.dtype)) if window or softcap else b.mask
        out = window_attention(
            queries,
            keys,
            values,
            mask,
            scale,
            softcap,
            is_causal=mask is None,
            enable_gqa=num_heads != num_kv_heads,
        )
        outs.append(out.transpose(1, 2).reshape(n * q_len, num_heads, head_dim))
    stacked = outs[0] if len(outs) == 1 else torch.cat(outs)
    return stacked if plan.output_rows is None else stacked.index_select(0, plan.output_rows)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [N, H, D] ragged by cu_seqlens_q [B+1]; seq_lens [B] total kv length -> [N, H, D]."""
    plan = plan_extend(block_table, cu_seqlens_q, seq_lens, page_size, q.shape[1], k_cache)
    return extend_attention_planned(q, k_cache, v_cache, plan, scale, window, softcap)
