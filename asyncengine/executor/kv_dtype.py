"""The K/V pool's element type: the ``kv_cache_dtype`` config key resolved for a model.

``"auto"`` on a CPU, outside deterministic mode, picks the narrowest pool measured faster there:

- ``int8`` beside bfloat16 activations where the int8 decode attention takes its integer dot
  products for the model's head dim (AVX-512 VNNI builds, ``cpu_native.kv_i8_query_dots``). A
  decode step streams every key and value of its request per layer; int8 rows halve those bytes
  and hold ~2x the tokens per ``kv_cache_bytes``. Beside a bfloat16 pool it decoded 8,000 keys
  faster and ran the offline mix no slower, with perplexity within 0.5%
  (docs/BENCHMARKS.md, "How fast at long contexts"; scripts/kv_int8_accuracy.py).
- ``float16`` beside float32 activations of quantized weights where every native kernel reads
  float16 through F16C on the AVX2 + FMA build (llama.cpp's default K/V type too). AVX-512
  builds read float16 through a slower per-item loop, so they keep float32.
- the model's dtype otherwise (dense float32 checkpoints, GPUs: nothing measured there yet,
  deterministic mode).

An explicit value must be honoured or refused: the model's own dtype always; float16 on a CPU
beside float32 activations (the kernels' -DKV_F16 builds, or the torch references where no
kernel runs), not in deterministic mode (its torch fallback reads the pool in the model's
dtype). ``int8`` (a scale per token and head: kernels/reference/kv_int8_ref.py) likewise: on a
CPU beside float32 or bfloat16 activations, with the torch attention backend (the native
kernels' -DKV_I8 builds; the torch references dequantizing to the queries' dtype where no
kernel runs), deterministic mode too (its native extend kernel reads int8 rows, its torch
fallback dequantizes each row alone); on CUDA beside the same activations where the Triton
kernels attend (attention_backend triton, or auto with Triton installed; not in deterministic
mode, which runs torch's): their store kernels quantize, their attention kernels dequantize on
load. FlashInfer's kernels do not read it. ``fp8`` (e4m3 values with the same scales:
kernels/reference/kv_fp8_ref.py) likewise on CUDA only, on GPUs of compute capability 8.9 or
newer (Ada, Hopper and later convert e4m3 in hardware). Which activations each pool sits beside
is one rule: kernels/pool_pairs.py.
Anything else is a ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from asyncengine.common.config import ConfigError
from asyncengine.executor.attention.selector import resolve_backend_name
from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.attention_native import extend_kernel_features
from asyncengine.kernels.pool_pairs import beside_what, pool_fits
from asyncengine.kernels.quant_formats import F32, QuantizedTensor
from asyncengine.kernels.reference.kv_int8_ref import SCALED_POOLS

KV_DTYPE_NAMES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}

_AVX512, _AVX2 = 1, 4  # extend_kernel_features bits


def keeps_quantized_weights(weights: Mapping[str, object]) -> bool:
    """Whether a loaded model holds weights in a stored quantized format (not F32 rows)."""
    return any(isinstance(w, QuantizedTensor) and w.format != F32 for w in weights.values())


def f16_pool_runs_natively() -> bool:
    """Every native kernel that touches the pool has a float16 build reading it through F16C,
    and the extend kernel's build is the AVX2 + FMA one (where a half pool was measured)."""
    if not cpu_native.kv_f16_native():
        return False
    features = extend_kernel_features(torch.float16)
    return bool(features & _AVX2) and not features & _AVX512


def int8_pool_runs_natively(head_dim: int, backend: str = "auto") -> bool:
    """Whether the int8 decode attention takes integer dot products for heads of ``head_dim``
    here (AVX-512 VNNI builds) and ``backend`` reads an int8 pool."""
    return (
        head_dim > 0
        and backend in ("auto", "torch")
        and cpu_native.kv_i8_query_dots(head_dim)
        and cpu_native.kv_i8_native()
    )


def _triton_reads(device: torch.device, backend: str, deterministic: bool) -> str:
    """Why the Triton kernels would not attend on ``device`` ("" where they would)."""
    if deterministic:
        return f"deterministic mode on {device.type} runs the torch attention backend"
    resolved = resolve_backend_name(backend, device) if backend == "auto" else backend
    if resolved == "triton":
        return ""
    return f"attention_backend {backend!r} does not read it (use triton, or auto with Triton)"


def _scaled_refusal(
    wanted: torch.dtype, device: torch.device, dtype: torch.dtype, backend: str, deterministic: bool
) -> str:
    """Why a pool of int8 or fp8 rows with their scales cannot be honoured here ("" where it
    can)."""
    name = "int8" if wanted == torch.int8 else "fp8"
    if wanted != torch.int8 and device.type != "cuda":
        return (
            f"on {device.type} no attention kernel reads an fp8 pool (CUDA with the Triton "
            "backend only; int8 halves a bfloat16 pool on a CPU too)"
        )
    if device.type not in ("cpu", "cuda"):
        return f"on {device.type} no attention kernel reads an int8 pool (CPU or CUDA only)"
    if not pool_fits(wanted, dtype):
        model = str(dtype).removeprefix("torch.")
        return (
            f"an {name} pool is read beside {beside_what(wanted)} activations only "
            f"(the model runs in {model})"
        )
    if device.type == "cpu":
        if backend in ("auto", "torch"):
            return ""
        return (
            f"attention_backend {backend!r} does not read an int8 pool on cpu (use torch or auto)"
        )
    why = _triton_reads(device, backend, deterministic)
    if why:
        return f"on cuda only the Triton kernels read an {name} pool: {why}"
    if wanted == torch.int8:
        return ""
    major, minor = torch.cuda.get_device_capability(device)  # e4m3 in hardware from 8.9
    if (major, minor) < (8, 9):
        return (
            f"an fp8 (e4m3) pool needs a GPU of compute capability 8.9 or newer (this one is "
            f"{major}.{minor}); int8 halves the pool there too"
        )
    return ""


def pick_kv_dtype(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    quantized: bool,
    deterministic: bool,
    backend: str = "auto",
    head_dim: int = 0,
) -> torch.dtype:
    """The pool's dtype for ``kv_cache_dtype = name`` and a model of ``dtype`` with heads of
    ``head_dim`` (0: unknown) on ``device`` whose attention runs on ``backend`` (the
    ``attention_backend`` config key)."""
    on_cpu = device.type == "cpu"
    if name == "auto":
        if not on_cpu or deterministic:
            return dtype
        if dtype == torch.bfloat16 and int8_pool_runs_natively(head_dim, backend):
            return torch.int8
        half = quantized and dtype == torch.float32
        return torch.float16 if half and f16_pool_runs_natively() else dtype
    if name not in KV_DTYPE_NAMES:
        raise ConfigError(
            f"config key 'kv_cache_dtype' = {name!r}: expected auto or one of "
            f"{', '.join(KV_DTYPE_NAMES)}"
        )
    wanted = KV_DTYPE_NAMES[name]
    if wanted in SCALED_POOLS:
        why = _scaled_refusal(wanted, device, dtype, backend, deterministic)
        if why:
            raise ConfigError(f"config key 'kv_cache_dtype' = {name!r}: {why}")
        return wanted
    if wanted == dtype:
        return wanted
    model = str(dtype).removeprefix("torch.")
    fits = on_cpu and pool_fits(wanted, dtype)
    if wanted == torch.float16 and fits and not deterministic:
        return wanted
    if wanted == torch.float16 and fits:
        why = "deterministic mode reads the pool in the model's dtype"
    elif wanted == torch.float16 and on_cpu:
        why = (
            f"a float16 pool is read beside {beside_what(torch.float16)} activations only "
            f"(the model runs in {model})"
        )
    elif on_cpu:
        why = (
            f"on cpu the pool is kept in the model's dtype ({model}), or in float16 beside "
            "float32 activations"
        )
    else:
        why = f"on {device.type} the pool is kept in the model's dtype ({model})"
    raise ConfigError(f"config key 'kv_cache_dtype' = {name!r}: {why}")
