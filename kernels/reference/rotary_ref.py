"""Rotary position embedding reference, neox (rotate-half) layout."""

from __future__ import annotations

import torch


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, D], k [N, Hkv, D] rotated at positions [N]; cache [max_pos, D] = cos | sin halves.

    The cos/sin rows are rounded to q's dtype before use, as HF does.
    """
    cos, sin = cos_sin_for_positions(positions, cos_sin_cache, q.dtype)
    return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)


def cos_sin_for_positions(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) each [N, 1, D/2] in dtype, ready to broadcast over heads."""
    rows = cos_sin_cache.index_select(0, positions).to(dtype)
    cos, sin = rows.unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with cos/sin given once per half: [N, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
