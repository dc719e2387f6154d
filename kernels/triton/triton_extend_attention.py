"""Extend (prefill) attention in Triton over a paged KV cache, flash-attention style.

The new tokens of each request attend fully to the request's cached prefix and causally to
themselves; the runner has already stored their K/V, so every key and value is read from the
pages. One program per (query block, query head, request) runs an online softmax over the key
blocks up to the last position its query block can see. Batches are ragged: ``cu_seqlens_q``
gives each request's rows of ``q``, ``seq_lens`` its total KV length (prefix + new).
A sliding window (``window`` > 0: a query at p sees keys p - window + 1 .. p) starts each
program at the first key block its queries can see; soft-capping (``softcap`` > 0) maps the
scaled scores s to softcap * tanh(s / softcap) before the softmax.
An int8 or fp8 pool (rows of one-byte values and their scales: triton_kv_quant.py) is read as
its values in the dot's operand type, each key's scale taken on its dot products and each
value's on its softmax weights.
"""

from __future__ import annotations

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
    next_power_of_2,
    soft_cap,
)

LOG2_E = 1.4426950408889634
# Autotuning picks a config per bucket of the longest extend (tokens).
Q_LEN_BUCKETS = (128, 1024)

_EXTEND_CONFIGS = autotune_configs(
    [
        triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        for block_m, block_n, warps, stages in [
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 4, 3),
            (128, 64, 8, 3),
            (128, 32, 4, 3),
            (64, 32, 4, 4),
        ]
    ],
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1),
)


# q_len_bucket (short, medium or long longest extend, Q_LEN_BUCKETS) keeps a config tuned on a
# short batch from being reused for long prefills.
@autotune(configs=_EXTEND_CONFIGS, key=["HEAD_DIM", "GROUP", "q_len_bucket"])
@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    block_table_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    scale_log2,
    window,
    softcap_log2,
    page_size,
    stride_qn,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
    stride_on,
    stride_oh,
    stride_bt,
    q_len_bucket,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANTIZED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        prefix_len = seq_len - q_len
        kv_head = head // GROUP

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        q_pos = prefix_len + offs_m

        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        ).to(DOT_DTYPE)

        # Finite floor: rows past q_len may see no key in a block without making NaNs.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # The last query of this block sits at prefix_len + (m_block + 1) * BLOCK_M - 1.
        kv_end = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)
        table_row = block_table_ptr + b * stride_bt
        # the first key the block's first query sees (0 without a window)
        kv_start = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0) * (window > 0)
        for block_start in range((kv_start // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
            pos = block_start + offs_n
            mask_n = pos < kv_end
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
            visible = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
            visible = visible & ((pos[None, :] > q_pos[:, None] - window) | (window <= 0))
            scores = tl.where(visible, scores, float("-inf"))

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

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_on + head * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of ragged new tokens over their paged prefix and themselves.

    q ``[N, H, D]`` ragged by cu_seqlens_q ``[B+1]`` int32; k_cache, v_cache ``[S, Hkv, D]``
    (int8, fp8: ``[S, Hkv, D + 2]``); seq_lens ``[B]`` int32 (total KV length incl. the new
    tokens); query ``i`` of request ``b`` sits at position
    ``seq_lens[b] - q_len[b] + i``. Returns ``[N, H, D]`` in ``q.dtype``. Pass ``max_q_len``
    (the longest request's new tokens) when known to avoid a device-to-host read; ``out``
    (``[N, H, D]``, last dim contiguous) receives the result instead of a new tensor.
    ``window``: keys a query sees, itself included (0: all); ``softcap``: 0 off.
    """
    check_device(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the head dimension of q, k_cache and v_cache must be contiguous")
    k_scales, v_scales, *scale_strides = attention_scales(head_dim, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} must match q {tuple(q.shape)}, last dim contiguous"
        )
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if max_q_len == 0:
        return out

    def grid(meta: dict[str, int]) -> tuple[int, int, int]:
        return (triton.cdiv(max_q_len, meta["BLOCK_M"]), num_heads, batch)

    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        out,
        block_table,
        cu_seqlens_q,
        seq_lens,
        scale * LOG2_E,
        window,
        softcap * LOG2_E,
        page_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        *scale_strides,
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        length_bucket(max_q_len, Q_LEN_BUCKETS),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(next_power_of_2(head_dim), 16),
        DOT_DTYPE=dot_dtype(q.dtype),
        SOFTCAP=softcap > 0,
        QUANTIZED=is_quantized(k_cache),
    )
    return out
