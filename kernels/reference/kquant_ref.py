"""Float weights to the K formats' blocks (Q4_K, Q5_K, Q6_K), for tests and benchmarks: the
``gguf`` package dequantizes these formats but cannot quantize them.

A plain round-to-nearest quantizer (no search for the best scales as llama.cpp's has): each
sub-block's scale (and min) from its range, the scales themselves quantized to 6 bits (8 bits,
signed, for Q6_K) against one fp16 super-scale. The blocks are valid GGUF blocks of the format;
their error is a little above llama-quantize's.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncengine.kernels.quant_formats import Q4_K, Q5_K, Q6_K, QuantFormat, QuantizedTensor

SUPER = 256


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes, as Q4_K / Q5_K pack them."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _q45_blocks(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """[n, 256] -> (d, dmin [n], sc, m [n, 8] 6-bit, q [n, 256] 0..levels)"""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - low) / levels
    d = scale.max(axis=1) / 63.0
    dmin = -low.min(axis=1) / 63.0
    d16, dmin16 = (
        d.astype(np.float16).astype(np.float32),
        dmin.astype(np.float16).astype(np.float32),
    )
    sc = np.clip(
        np.rint(np.divide(scale, d16[:, None], where=d16[:, None] > 0, out=np.zeros_like(scale))),
        0,
        63,
    )
    m = np.clip(
        np.rint(
            np.divide(-low, dmin16[:, None], where=dmin16[:, None] > 0, out=np.zeros_like(low))
        ),
        0,
        63,
    )
    step = d16[:, None] * sc
    offset = dmin16[:, None] * m
    q = np.divide(
        sub + offset[:, :, None],
        step[:, :, None],
        where=step[:, :, None] > 0,
        out=np.zeros_like(sub),
    )
    q = np.clip(np.rint(q), 0, levels).astype(np.uint8).reshape(-1, SUPER)
    return d16, dmin16, sc.astype(np.uint8), m.astype(np.uint8), q


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _q45_blocks(x, 15)
    chunks = q.reshape(-1, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales(sc, m), qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _q45_blocks(x, 31)
    low = q & 0xF
    chunks = low.reshape(-1, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 8, 32)  # [n, sub-block j, l]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= (high[:, j] << j).astype(np.uint8)
    return np.concatenate(
        [_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales(sc, m), qh, qs],
        axis=1,
    )


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    amax = np.abs(sub).max(axis=2)
    scale = amax / 31.0
    d = (scale.max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(
        np.rint(np.divide(scale, d[:, None], where=d[:, None] > 0, out=np.zeros_like(scale))),
        -127,
        127,
    )
    step = d[:, None] * sc
    q = np.divide(sub, step[:, :, None], where=step[:, :, None] != 0, out=np.zeros_like(sub))
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # half, g, l
    # per half: ql bytes 0..31 hold groups 0 (low nibble) and 2, bytes 32..63 groups 1 and 3
    ql = np.concatenate(
        [(q[:, h, i] & 0xF) | ((q[:, h, i + 2] & 0xF) << 4) for h in range(2) for i in range(2)],
        axis=1,
    )
    qh = np.concatenate(
        [
            (q[:, h, 0] >> 4)
            | ((q[:, h, 1] >> 4) << 2)
            | ((q[:, h, 2] >> 4) << 4)
            | ((q[:, h, 3] >> 4) << 6)
            for h in range(2)
        ],
        axis=1,
    )
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _fp16_bytes(d)], axis=1)


_QUANTIZERS = {Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}


def quantize_k(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedTensor:
    """A float [rows, cols] weight (cols a multiple of 256) in fmt (Q4_K, Q5_K or Q6_K)."""
    rows, cols = weight.shape
    if fmt not in _QUANTIZERS:
        raise ValueError(f"{fmt.name} is not a K format")
    if cols % SUPER:
        raise ValueError(f"K-format rows hold multiples of {SUPER} values, not {cols}")
    blocks = _QUANTIZERS[fmt](weight.detach().float().numpy().reshape(-1, SUPER))
    data = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8)).reshape(rows, -1)
    return QuantizedTensor(fmt, data, cols)
