"""Choosing the attention backend (and the matching elementwise kernels) for a device.

``attention_backend`` in the engine config is one of (``config.ATTENTION_BACKENDS``):

- ``"auto"``: Triton on CUDA (torch when Triton cannot be imported), torch on CPU;
- ``"torch"``: the torch references (any device);
- ``"triton"``: the Triton kernels; on CUDA, or on CPU only under ``TRITON_INTERPRET=1`` (the
  Triton interpreter, for tests: far too slow to serve);
- ``"flashinfer"``: FlashInfer's paged prefill and decode kernels for attention, the Triton
  kernels for the rest (CUDA only; needs the flashinfer-python package, whose kernels compile
  on first use; executor/attention/flashinfer_backend.py).

A choice that cannot work on the device fails here, with a message that says what to do,
rather than deep inside the first forward.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncengine.common.config import ATTENTION_BACKENDS
from asyncengine.executor.attention.torch_backend import AttentionBackend, TorchBackend


class BackendUnavailableError(RuntimeError):
    """The configured attention backend cannot run on the device it was given."""


def _triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """The concrete backend (``torch``, ``triton`` or ``flashinfer``) that ``name`` means here."""
    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}: expected one of {', '.join(ATTENTION_BACKENDS)}"
        )
    on_cuda = device.type == "cuda"
    if name == "auto":
        return "triton" if on_cuda and _importable("triton") else "torch"
    if name == "triton":
        if not _importable("triton"):
            raise BackendUnavailableError(
                "attention_backend='triton' needs the triton package (pip install triton); "
                "or use attention_backend='torch'"
            )
        if not on_cuda and not (device.type == "cpu" and _triton_interpreter()):
            raise BackendUnavailableError(
                f"attention_backend='triton' needs a CUDA device, not {device}; use "
                "attention_backend='torch' (or 'auto') there. Triton runs on CPU only under "
                "TRITON_INTERPRET=1, the test interpreter, which is far too slow to serve"
            )
    if name == "flashinfer":
        missing = [m for m in ("flashinfer", "triton") if not _importable(m)]
        if missing:
            raise BackendUnavailableError(
                f"attention_backend='flashinfer' needs the package(s) {', '.join(missing)} "
                "(pip install flashinfer-python triton); or use attention_backend='triton'"
            )
        if not on_cuda:
            raise BackendUnavailableError(
                f"attention_backend='flashinfer' needs a CUDA device, not {device}; use "
                "attention_backend='torch' (or 'auto') there"
            )
    return name


def create_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Resolve ``name`` for ``device`` and build that backend."""
    resolved = resolve_backend_name(name, device)
    if resolved == "triton":
        from asyncengine.executor.attention.triton_backend import TritonBackend

        return TritonBackend()
    if resolved == "flashinfer":
        from asyncengine.executor.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    return TorchBackend()


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The elementwise kernels beside attention, with the signatures of kernels/reference/*_ref.py.

    ``rotary_store`` (native CPU kernels; the Triton backend's fused kernel) rotates q and k and
    stores k and v into the layer's cache in one pass (``kernels.layer_ops_native.rotary_store``,
    ``kernels.triton.triton_rotary_store.rotary_store``), the backend then ``attend``s; None: the
    model calls ``apply_rotary`` and the backend stores k and v.
    """

    store_kv: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    rotary_store: Callable[..., torch.Tensor] | None = None


def kernel_ops(resolved_backend: str, device: torch.device | str = "cpu") -> KernelOps:
    """The torch references for the torch backend, with the native CPU kernels in place of the
    norms, the activation and rotary + KV store where they are available (kernels/cpu/*.c: on a CPU
    with a C compiler); the Triton twins for triton.

    Note: the Triton ``apply_rotary`` rotates q and k in place (and returns them); the
    reference returns new tensors. Callers must use the returned tensors.
    """
    if resolved_backend == "torch":
        from asyncengine.kernels.cpu import layer_ops_native as native
        from asyncengine.kernels.reference.activation_ref import silu_and_mul
        from asyncengine.kernels.reference.kv_store_ref import store_kv
        from asyncengine.kernels.reference.norm_ref import fused_add_rms_norm, rms_norm
        from asyncengine.kernels.reference.rotary_ref import apply_rotary

        if torch.device(device).type == "cpu" and native.available():
            return KernelOps(
                store_kv=store_kv,
                rms_norm=native.rms_norm,
                fused_add_rms_norm=native.fused_add_rms_norm,
                apply_rotary=apply_rotary,
                silu_and_mul=native.silu_and_mul,
                rotary_store=native.rotary_store,
            )
    elif resolved_backend in ("triton", "flashinfer"):  # FlashInfer attends, Triton does the rest
        from asyncengine.kernels.triton.triton_activation import silu_and_mul
        from asyncengine.kernels.triton.triton_kv_store import store_kv
        from asyncengine.kernels.triton.triton_norm import fused_add_rms_norm, rms_norm
        from asyncengine.kernels.triton.triton_rotary import apply_rotary

        if resolved_backend == "triton":  # its attend reads what the fused kernel stored
            from asyncengine.kernels.triton.triton_rotary_store import rotary_store

            return KernelOps(
                store_kv=store_kv,
                rms_norm=rms_norm,
                fused_add_rms_norm=fused_add_rms_norm,
                apply_rotary=apply_rotary,
                silu_and_mul=silu_and_mul,
                rotary_store=rotary_store,
            )
    else:
        raise ValueError(f"kernel_ops takes a resolved backend name, not {resolved_backend!r}")
    return KernelOps(
        store_kv=store_kv,
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        apply_rotary=apply_rotary,
        silu_and_mul=silu_and_mul,
    )
