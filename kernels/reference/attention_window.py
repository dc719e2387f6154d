"""Sliding windows and soft-capping for the torch attention references (Gemma 2/3).

A query at position p of a layer with window W sees keys p - W + 1 .. p (W keys, itself
included; W = 0: every key up to p), as Hugging Face's ``sliding_window_overlay``. Soft-capping
maps the scaled scores s to cap * tanh(s / cap) before masking and softmax; torch's fused
attention has no such step, so capped layers take ``capped_attention`` (scores materialized
in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hidden_keys(query_pos: torch.Tensor, kv_len: int, window: int) -> torch.Tensor:
    """[..., Lq] int64 positions -> [..., Lq, kv_len] bool: True where a key is not seen."""
    keys = torch.arange(kv_len, device=query_pos.device)
    pos = query_pos[..., None]
    hidden = keys > pos
    if window > 0:
        hidden |= keys <= pos - window
    return hidden


def additive_mask(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return mask.masked_fill_(hidden, float("-inf"))


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(scores / cap) * cap


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """q [n, H, Lq, D] over k, v [n, Hkv, L, D] (H a multiple of Hkv), additive ``mask``
    broadcastable to [n, H, Lq, L]; scores soft-capped, all math in float32 -> q's dtype."""
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float(), v.float()
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)
        vf = vf.repeat_interleave(group, dim=1)
    scores = soft_cap(torch.matmul(q.float(), kf.transpose(-1, -2)) * scale, softcap)
    probs = torch.softmax(scores + mask.float(), dim=-1)
    return torch.matmul(probs, vf).to(q.dtype)


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    *,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch's fused attention, or ``capped_attention`` where ``softcap`` is set (it then needs
    the additive ``mask``: ``is_causal`` is the fused path's alternative to one)."""
    if softcap:
        assert mask is not None, "soft-capped attention takes an explicit mask"
        return capped_attention(q, k, v, mask, scale, softcap)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
