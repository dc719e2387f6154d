"""RoPE frequencies and the cos/sin cache, computed exactly as Hugging Face computes them."""

from __future__ import annotations

import math

import torch

from asyncengine.executor.layers.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) after the config's scaling (not dynamic)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, config)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(config)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    s = config.rope_scaling
    old_context_len = s.original_max_position_embeddings or config.max_position_embeddings
    low_freq_wavelen = old_context_len / s.low_freq_factor
    high_freq_wavelen = old_context_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(config: ModelConfig) -> torch.Tensor:
    """YaRN: the original frequencies for the dimensions that turn more than beta_fast times over
    the original length, the interpolated ones (divided by factor) for those that turn fewer
    than beta_slow times, a linear ramp between (HF's order of float32 operations)."""
    s = config.rope_scaling
    dim, base = config.head_dim, config.rope_theta
    original = s.original_max_position_embeddings or config.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def build_cos_sin_cache(config: ModelConfig, max_len: int | None = None) -> torch.Tensor:
    """[max_len, head_dim] float32: cos in the first half, sin in the second.

    YaRN scales cos and sin by its attention factor, as HF does. Dynamic NTK: positions inside max_position_embeddings use the plain frequencies; position p
    beyond uses the base HF derives for seq_len = p + 1, which is what HF applies when it decodes
    that token alone (HF rescales a whole prefill by its longest position instead).
    """
    max_len = config.max_model_len if max_len is None else max_len
    inv_freq = rope_inv_freq(config)
    dynamic = config.rope_scaling.rope_type == "dynamic"
    dynamic_from = config.max_position_embeddings if dynamic else max_len
    if dynamic_from < max_len:
        far = _dynamic_freqs(config, max_len)
    half = inv_freq.numel()
    attention_factor = config.rope_scaling.attention_factor
    table = torch.empty(max_len, 2 * half, dtype=torch.float32)
    # a block of positions at a time: the temporaries stay small (a 128k-position table's
    # would be 160 MB of fresh memory: a third of a 3B model's start-up in a VM)
    for lo in range(0, max_len, ROWS_PER_BLOCK):
        hi = min(lo + ROWS_PER_BLOCK, max_len)
        freqs = torch.arange(lo, hi, dtype=torch.float32)[:, None] * inv_freq[None, :]
        if dynamic_from < hi:
            start = max(lo, dynamic_from)
            freqs[start - lo :] = far[start - dynamic_from : hi - dynamic_from]
        table[lo:hi, :half] = freqs.cos() * attention_factor
        table[lo:hi, half:] = freqs.sin() * attention_factor
    return table


ROWS_PER_BLOCK = 4096


def _dynamic_freqs(config: ModelConfig, max_len: int) -> torch.Tensor:
    dim = config.head_dim
    factor = config.rope_scaling.factor
    max_pos = config.max_position_embeddings
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    positions = torch.arange(max_pos, max_len, dtype=torch.float64)
    bases = config.rope_theta * ((factor * (positions + 1) / max_pos) - (factor - 1)) ** (
        dim / (dim - 2)
    )
    inv_freq = 1.0 / (bases[:, None].to(torch.float32) ** exponents[None, :])
    return positions[:, None].to(torch.float32) * inv_freq
