"""Where and in what precision the model runs: one choice of device, one of dtype."""

from __future__ import annotations

import torch

from asyncengine.common.config import ConfigError
from asyncengine.executor.cpu.cpu_dtype import fastest_cpu_dtype

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def pick_device(name: str | torch.device) -> torch.device:
    """``auto``: CUDA when there is one, else the CPU."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'device' = 'cuda': no CUDA device is available here")
    return torch.device(name)


def pick_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, and on a CPU whichever of bfloat16/float32 multiplies
    faster here (executor/cpu/cpu_dtype.py). float16 on a CPU is refused (~300x slower)."""
    device = torch.device(device)
    if name == "auto":
        return fastest_cpu_dtype() if device.type == "cpu" else torch.bfloat16
    if isinstance(name, str):
        if name not in _DTYPE_NAMES:
            raise ConfigError(
                f"config key 'dtype' = {name!r}: expected auto or one of {', '.join(_DTYPE_NAMES)}"
            )
        name = _DTYPE_NAMES[name]
    if name not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"config key 'dtype' = {name}: use float32 or bfloat16")
    if name == torch.float16 and device.type == "cpu":
        raise ConfigError(
            "config key 'dtype' = 'float16': float16 is refused on CPU, its matmuls run ~300x "
            "slower there; use bfloat16 (fast) or float32 (exact)"
        )
    return name
