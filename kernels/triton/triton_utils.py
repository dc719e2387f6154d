"""Shared helpers of the Triton kernels: interpreter detection, autotune lists, dot dtypes.

Under ``TRITON_INTERPRET=1`` (the CPU test mode) the kernels run in numpy, one program at a
time: every autotune list collapses to one small config (autotuning there would only multiply
the runtime), and every ``tl.dot`` takes float32 operands because the interpreter's bf16/fp16
``tl.dot`` is not exact enough to serve as a test.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
import triton
import triton.language as tl


def is_interpreter() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_configs(
    gpu_configs: list[triton.Config], interpreter_config: triton.Config
) -> list[triton.Config]:
    """The configs to autotune over: the GPU list, or the one interpreter config.

    The list is chosen when a kernel module is imported, so set ``TRITON_INTERPRET`` before
    importing ``asyncengine.kernels.triton_*`` (tests/conftest.py does). ``ASYNCENGINE_TRITON_AUTOTUNE=0``
    keeps only the first GPU config: a correctness sweep over many shapes then compiles each
    specialization once instead of once per config (scripts/check_kernels_gpu.py).
    """
    if is_interpreter():
        return [interpreter_config]
    if os.environ.get("ASYNCENGINE_TRITON_AUTOTUNE", "1") == "0":
        return gpu_configs[:1]
    return gpu_configs


def autotune(configs: list[triton.Config], key: list[str]) -> Any:
    """``triton.autotune`` that keeps its picks on disk where this Triton can (``cache_results``):
    a restarted server then skips the benchmarking its warm-up would otherwise repeat."""
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        return triton.autotune(configs=configs, key=key, cache_results=True)
    return triton.autotune(configs=configs, key=key)


def length_bucket(length: int, edges: tuple[int, ...]) -> int:
    """The first of ``edges`` that holds ``length``, or ``2 * edges[-1]`` past them all.

    Autotuning keys on it: a config is re-picked for short, medium and long work, not for every
    power of two (each new key costs a round of benchmarks, which a warm-up must pay up front).
    """
    for edge in edges:
        if length <= edge:
            return edge
    return 2 * edges[-1]


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand type of ``tl.dot`` for tensors of ``dtype``.

    float32 everywhere under the interpreter; on a GPU, half-precision tiles go to the tensor
    cores as they are (accumulating in float32), float32 tiles stay float32.
    """
    if is_interpreter() or dtype == torch.float32:
        return tl.float32
    return torch_to_triton_dtype(dtype)


def torch_to_triton_dtype(dtype: torch.dtype) -> tl.dtype:
    mapping: dict[torch.dtype, tl.dtype] = {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
    }
    if dtype not in mapping:
        raise TypeError(f"Triton kernels support float32, float16 and bfloat16, not {dtype}")
    return mapping[dtype]


def check_device(*tensors: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            continue
        if tensor.device.type == "cpu" and is_interpreter():
            continue
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got a tensor on {tensor.device}); "
            "CPU tensors are accepted only under TRITON_INTERPRET=1"
        )


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small stand-in on CPU (the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def soft_cap(x, cap):  # type: ignore[no-untyped-def]
    """cap * tanh(x / cap), tanh as sign(y) (1 - e^{-2|y|}) / (1 + e^{-2|y|}): no overflow."""
    y = x / cap
    t = tl.exp(-2.0 * tl.abs(y))
    r = (1.0 - t) / (1.0 + t)
    return cap * tl.where(y < 0.0, -r, r)
