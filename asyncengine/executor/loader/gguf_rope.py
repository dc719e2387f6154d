"""Llama 3's RoPE scaling back from a GGUF's ``rope_freqs`` tensor.

llama.cpp's converter does not store a Llama 3.1+ checkpoint's ``rope_type: llama3`` parameters:
it stores one factor per frequency (``rope_freqs.weight``; the model runs ``inv_freq / factor``).
The factors are 1 for short wavelengths, ``factor`` for long ones and, between, ``1 / ((1 - s) /
factor + s)`` with ``s = original / wavelen / (high - low) - low / (high - low)`` linear in
``1 / wavelen``; fitting that line gives HF parameters that reproduce every factor (checked).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncengine.executor.loader.hf_dir import ModelFilesError

_TOLERANCE = 1e-4  # relative; the factors are stored as float32


def llama3_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> list[float]:
    """The factors the converter writes for these HF llama3 parameters (its own formula)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def llama3_rope_parameters(factors: Sequence[float], theta: float, head_dim: int) -> dict[str, Any]:
    """HF ``rope_parameters`` (rope_type llama3) whose frequencies equal ``inv_freq / factors``;
    ModelFilesError when no llama3 parameters reproduce them."""
    values = np.asarray(factors, dtype=np.float64)
    if values.shape != (head_dim // 2,):
        raise ModelFilesError(f"rope_freqs has {values.size} factors, expected {head_dim // 2}")
    factor = float(values.max())
    if factor <= 1 + _TOLERANCE and values.min() >= 1 - _TOLERANCE:
        return {"rope_type": "default", "rope_theta": theta}
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    medium = (values > 1 + _TOLERANCE) & (values < factor * (1 - _TOLERANCE))
    smooth = (1 / values[medium] - 1 / factor) / (1 - 1 / factor)
    low, high = 1.0, 4.0
    if (
        medium.sum() >= 2
    ):  # smooth = a / wavelen - b: a = original / (high - low), b = low * a / original
        a, minus_b = np.polyfit(1 / wavelen[medium], smooth, 1)
        if minus_b < 0:
            high = low - 1 / minus_b
        original = round(a * (high - low))
    elif medium.sum() == 1:  # low and high at HF's defaults: the one point fixes original
        original = round(float(wavelen[medium][0]) * (3 * float(smooth[0]) + 1))
    else:  # no band between: put the low boundary just under the first scaled wavelength
        shortest_scaled = float(wavelen[values > 1 + _TOLERANCE].min())
        longest_kept = float(wavelen[values <= 1 + _TOLERANCE].max(initial=1.0))
        original = math.floor(shortest_scaled) - 1
        high = max(low + 1e-3, original / longest_kept * (1 - 1e-6))
    high = round(float(high), 4)
    parameters = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(original),
    }
    again = llama3_factors(theta, head_dim, factor, low, high, int(original))
    if not np.allclose(again, values, rtol=_TOLERANCE, atol=0):
        raise ModelFilesError(
            "GGUF tensor rope_freqs does not match Llama 3 RoPE scaling for any parameters "
            f"(best fit {parameters}): other per-frequency RoPE factors are not supported"
        )
    return parameters
