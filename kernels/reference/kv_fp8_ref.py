"""An fp8 (e4m3) K/V pool in torch: the rows the Triton store kernels write (bit for bit) and the
attention kernels read (kernels/triton/triton_kv_quant.py).

kv_int8_ref.py's layout with e4m3 values: a head's row of D values, then its bfloat16 scale in
the next 2 bytes (a pool layer is float8_e4m3fn [S, Hkv, D + 2]). The scale is amax / 448 (e4m3's
largest finite) rounded up to a bfloat16, a value x / scale rounded half-even to e4m3: 3 bits of
mantissa, so x = value * scale within 1/16 of x (where x / scale is normal). Read back with
kv_int8_ref.dequantize_kv, which takes either pool.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.reference.kv_int8_ref import _round_up_bf16

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_kv_fp8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> float8_e4m3fn [..., D + 2]: the values, then their bfloat16 scale's
    bytes."""
    x = x.to(torch.float32)
    scale = _round_up_bf16(x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, x / safe, torch.zeros_like(x)).clamp_(-E4M3_MAX, E4M3_MAX)
    scale_bytes = scale.to(torch.bfloat16).view(FP8)
    return torch.cat([q.to(FP8), scale_bytes], dim=-1)
