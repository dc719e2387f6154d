"""Gated MLP activations: SwiGLU (llama) and GeGLU with tanh-approximated GELU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] = gate | up  ->  silu(gate) * up  [N, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] = gate | up  ->  gelu_tanh(gate) * up  [N, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
