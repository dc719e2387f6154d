"""Paged decode attention in Triton: one query token per request over its KV pages.

Two kernels (flash-decoding):

1. ``_decode_split_kernel``: one program per (request, KV head, split). The program loads the
   query heads of its GQA group as one ``[BLOCK_H, D]`` tile, so every KV block is read once per
   group, and runs an online softmax over its share of the request's tokens. Each token's slot
   comes from the block table (``table[b, pos // page_size] * page_size + pos % page_size``), so
   any page size works. With one split it writes the output directly; otherwise it writes a
   partial output and its log-sum-exp (base 2).
2. ``_decode_merge_kernel``: one program per (request, query head) merges the splits by their
   log-sum-exp.

The number of splits depends only on static shapes (batch, KV heads, table width), never on
the values of ``seq_lens``, so the launch needs no device-to-host sync and can be captured in a
CUDA graph; each request divides its own length among the splits inside the kernel (with a
sliding window, only the keys inside it). Soft-capping maps the scaled scores s to
softcap * tanh(s / softcap) before the softmax.
An int8 or fp8 pool (rows of one-byte values and their scales: triton_kv_quant.py) is read as
its values in the dot's operand type, each key's scale taken on its dot products and each
value's on its softmax weights.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from asyncengine.kernels.triton.triton_kv_quant import (
    attention_scales,
    is_quantized,
    load_scales,
)
from asyncengine.kernels.triton.triton_utils import (
    autotune,
    autotune_configs,
    check_device,
    dot_dtype,
    length_bucket,
    multiprocessor_count,
    next_power_of_2,
    soft_cap,
)

LOG2_E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32
# Enough programs in flight to cover every multiprocessor several times over.
PROGRAMS_PER_SM = 4
# Autotuning picks a config per bucket of the block table's reach (tokens).
CONTEXT_BUCKETS = (1024, 8192)

_SPLIT_CONFIGS = autotune_configs(
    [
        triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        for block_n, warps, stages in [
            (32, 4, 2),
            (64, 4, 2),
            (64, 4, 3),
            (64, 8, 3),
            (128, 4, 2),
            (128, 8, 3),
        ]
    ],
    triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1),
)


# context_bucket (short, medium or long table reach, CONTEXT_BUCKETS) keeps a config tuned on a
# short batch from being reused for long contexts.
@autotune(configs=_SPLIT_CONFIGS, key=["HEAD_DIM", "BLOCK_H", "DIRECT", "context_bucket"])
@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    mid_out_ptr,
    mid_lse_ptr,
    scale_log2,
    window,
    softcap_log2,
    num_splits,
    page_size,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    context_bucket,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DIRECT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANTIZED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    # The first key the query sees (window > 0: the last `window` keys), and the block it is in.
    first_key = tl.maximum(seq_len - window, 0) * (window > 0)
    lo = (first_key // BLOCK_N) * BLOCK_N
    # Splits start on BLOCK_N boundaries; trailing splits of a short request are empty.
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    # A finite floor keeps exp2(m_i - m_new) defined when a row has seen no key yet.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    table_row = block_table_ptr + b * stride_bt
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + offs_n
        mask_n = pos < end
        page = tl.load(table_row + pos // page_size, mask=mask_n, other=0)
        slot = page.to(tl.int64) * page_size + pos % page_size
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_cache_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        if QUANTIZED:  # each key's scale on its dot products
            k_scale = load_scales(k_scale_ptr, slot, stride_kss, kv_head, stride_ksh, mask_n)
            scores = scores * k_scale[None, :]
        scores = scores * scale_log2
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        scores = tl.where(mask_n[None, :] & (pos[None, :] >= first_key), scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            v_cache_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(DOT_DTYPE)
        if QUANTIZED:  # each value's scale on its softmax weights
            v_scale = load_scales(v_scale_ptr, slot, stride_vss, kv_head, stride_vsh, mask_n)
            pv = p * v_scale[None, :]
        else:
            pv = p
        acc = acc * alpha[:, None] + tl.dot(pv.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = mask_h[:, None] & mask_d[None, :]
    if DIRECT:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        tl.store(
            mid_out_ptr
            + b * stride_mb
            + heads[:, None] * stride_mh
            + split * stride_ms
            + offs_d[None, :],
            out,
            mask=out_mask,
        )
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    mid_out_ptr,
    mid_lse_ptr,
    out_ptr,
    num_splits,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(
        mid_lse_ptr + b * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf")
    )
    lse_max = tl.max(lse, 0)
    # All splits empty (a zero-length padding row): weights are all zero, output zero.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, 0)
    partial = tl.load(
        mid_out_ptr
        + b * stride_mb
        + head * stride_mh
        + offs_s[:, None] * stride_ms
        + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per (request, KV head) so the launch covers the GPU; 1 when it already does."""
    programs = max(batch * num_kv_heads, 1)
    target = PROGRAMS_PER_SM * multiprocessor_count(device)
    if programs >= target:
        return 1
    wanted = math.ceil(target / programs)
    by_length = max(math.ceil(max_context / MIN_TOKENS_PER_SPLIT), 1)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} must match q {tuple(q.shape)}, last dim contiguous"
        )
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of one query token per request over its paged KV (incl. its own new token).

    q ``[B, H, D]``; k_cache, v_cache ``[S, Hkv, D]`` (int8, fp8: ``[S, Hkv, D + 2]``);
    block_table ``[B, P]`` int32; seq_lens ``[B]`` int32. Returns ``[B, H, D]`` in ``q.dtype``.
    ``num_splits`` overrides the split-K heuristic (tests use it to exercise the merge); ``out`` (``[B, H, D]``, last dim
    contiguous) receives the result instead of a new tensor. Rows with ``seq_lens == 0`` give 0.
    ``window``: keys the query sees, itself included (0: all); ``softcap``: 0 off.
    """
    check_device(q, k_cache, v_cache, block_table, seq_lens)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the head dimension of q, k_cache and v_cache must be contiguous")
    k_scales, v_scales, *scale_strides = attention_scales(head_dim, k_cache, v_cache)
    group = num_heads // num_kv_heads
    out = _output(q, out)
    if batch == 0:
        return out
    max_context = block_table.shape[1] * page_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, q.device)
    direct = num_splits == 1
    if direct:
        # Unused by the direct path; any tensor of the right kind keeps the signature simple.
        mid_out = out
        mid_lse = out
        mid_strides = (0, 0, 0)
        lse_strides = (0, 0)
    else:
        mid_out = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        mid_strides = (mid_out.stride(0), mid_out.stride(1), mid_out.stride(2))
        lse_strides = (mid_lse.stride(0), mid_lse.stride(1))

    block_d = max(next_power_of_2(head_dim), 16)
    block_h = max(next_power_of_2(group), 16)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_table,
        seq_lens,
        out,
        mid_out,
        mid_lse,
        scale * LOG2_E,
        window,
        softcap * LOG2_E,
        num_splits,
        page_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        *scale_strides,
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        *mid_strides,
        *lse_strides,
        length_bucket(max_context, CONTEXT_BUCKETS),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype(q.dtype),
        DIRECT=direct,
        SOFTCAP=softcap > 0,
        QUANTIZED=is_quantized(k_cache),
    )
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](
            mid_out,
            mid_lse,
            out,
            num_splits,
            *mid_strides,
            *lse_strides,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=max(next_power_of_2(num_splits), 2),
        )
    return out
