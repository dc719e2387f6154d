"""A whole decode step of a llama-family model with quantized weights in one native call
(kernels/cpu/cpu_decode_step.c), with what Qwen3 and Gemma 2/3 add to the llama layer where a
layer has it (``LayerParts``' optional fields: per-head q/k norms, sandwich norms, a sliding
window and its RoPE table, an attention soft-cap; ``DecodeShape.gelu``): the model's shape, its
layers' weights and its KV pool are described once (``DecodeStepModel``), then each step passes
only the batch's tensors.

float32 activations inside (a bfloat16 model's hidden states are widened on the way in and
rounded on the way out: between the two, nothing is rounded to bfloat16); a float32, float16 or
bfloat16 KV pool (float16: the library's -DKV_F16 build, ``cpu_native.kv_flags``; bfloat16: its
-DKV_BF16 build, ``KV_BUILD_FLAGS``); every projection in a stored format (``QuantizedTensor`` parts,
F32 rows among them; a fused projection of mixed formats being several parts). ``available()`` says whether the
library loaded.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.decode_step_lora import LoraDesc, StepLora
from asyncengine.kernels.cpu.plan_threads import plan_threads
from asyncengine.kernels.quant_formats import QuantizedTensor
from asyncengine.kernels.reference.kv_int8_ref import pool_row

MAX_PARTS = 4  # parts of one projection (MAX_PARTS in the C file)
MAX_HEAD_DIM = 256
_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class _Part(ctypes.Structure):
    _fields_ = [
        ("data", _PTR),
        ("bias", _PTR),
        ("row_bytes", _I64),
        ("rows", _I64),
        ("fmt", _I32),
        ("interleaved", _I32),
    ]


class _Linear(ctypes.Structure):
    _fields_ = [("parts", _Part * MAX_PARTS), ("num_parts", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        ("q_norm", _PTR),  # NULL: no per-head q/k norms
        ("k_norm", _PTR),
        ("attn_out_norm", _PTR),  # NULL: no sandwich norms
        ("mlp_out_norm", _PTR),
        ("cos_sin", _PTR),  # NULL: the model's table
        ("window", _I64),  # 0: every key
        ("softcap", _F32),  # 0: none
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("qkv", _Linear),
        ("o_proj", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _I64),
        ("hidden", _I64),
        ("num_heads", _I64),
        ("num_kv_heads", _I64),
        ("head_dim", _I64),
        ("inter", _I64),
        ("rope_rows", _I64),
        ("eps", _F32),
        ("scale", _F32),
        ("cos_sin", _PTR),
        ("final_norm", _PTR),
        ("layers", ctypes.POINTER(_Layer)),
        ("lora", ctypes.POINTER(LoraDesc)),  # set for a step with adapter rows only
        ("gelu", _I64),
    ]


# each pool dtype's build of the library (cpu_kv.h): the other KV libraries read a bfloat16 pool
# through a flag of their own, the step through a build of its own
KV_BUILD_FLAGS = {
    torch.float32: (),
    torch.float16: cpu_native.kv_flags(torch.float16),
    torch.bfloat16: ("-DKV_BF16",),
    torch.int8: cpu_native.kv_flags(torch.int8),
}


@functools.cache
def _library(kv_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    lib = cpu_native.load("cpu_decode_step", KV_BUILD_FLAGS[kv_dtype])
    if lib is None:
        return None
    fn = lib.asyncengine_decode_step
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.POINTER(_Model), _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, ctypes.c_int
    ]  # fmt: skip
    # and the threads its attention items are planned for (plan_threads.py)
    planned = lib.asyncengine_decode_step_planned
    planned.restype = ctypes.c_int
    planned.argtypes = [*fn.argtypes, ctypes.c_int]
    attention = lib.asyncengine_group_attention
    attention.restype = ctypes.c_int
    attention.argtypes = [
        _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _F32,
        _PTR, ctypes.c_int,
    ]  # fmt: skip
    return lib


def available(kv_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the step's build for a pool of ``kv_dtype`` loads (compiled here if need be)."""
    return kv_dtype in KV_DTYPES and _library(kv_dtype) is not None


KV_DTYPES = tuple(KV_BUILD_FLAGS)
HIDDEN_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class ProjectionParts:
    """One projection as the kernel takes it: its quantized parts (rows in order) and an
    optional float32 bias over all their rows."""

    parts: Sequence[QuantizedTensor]
    bias: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LayerParts:
    input_norm: torch.Tensor  # [hidden] float32
    post_norm: torch.Tensor  # [hidden] float32
    qkv: ProjectionParts  # [q_size + 2 kv_size, hidden]
    o_proj: ProjectionParts  # [hidden, q_size]
    gate_up: ProjectionParts  # [2 inter, hidden]: gate rows, then up rows
    down: ProjectionParts  # [hidden, inter]
    # [head_dim] float32 each: every q / k head RMS-normed by them before RoPE (Qwen3, Gemma 3)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # [hidden] each: o_proj's / down's output RMS-normed by them before the residual add (Gemma 3)
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int = 0  # keys a row sees, its own included (a sliding layer); 0: all
    cos_sin: torch.Tensor | None = None  # this layer's RoPE table; None: the model's
    softcap: float = 0.0  # scaled scores s -> softcap * tanh(s / softcap) (Gemma 2); 0: none


@dataclass(frozen=True, slots=True)
class DecodeShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    rms_norm_eps: float
    scale: float
    gelu: bool = False  # the MLP's gate: GELU in its tanh form (Gemma), else SiLU


class DecodeStepModel:
    """The model as the native decode step reads it. Holds references to every tensor whose
    address it hands to C, so they live as long as it does."""

    def __init__(
        self,
        shape: DecodeShape,
        layers: Sequence[LayerParts],
        final_norm: torch.Tensor,
        cos_sin: torch.Tensor,
        max_rows: int = 1 << 30,
    ) -> None:
        if shape.head_dim > MAX_HEAD_DIM or shape.head_dim % 2:
            raise ValueError(f"head_dim {shape.head_dim} is not even and <= {MAX_HEAD_DIM}")
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError("query heads must be a multiple of the kv heads")
        self.shape = shape
        self.max_rows = max_rows  # the most decode rows a step is given (the caller's limit)
        self._keep: list[Any] = []
        self._layers = (_Layer * len(layers))()
        self.cos_sin = self._float(cos_sin)
        rope_rows = self.cos_sin.shape[0]
        # adapter rows (LoRA) add their updates where a sandwich norm needs the whole row first
        self.takes_lora = not any(
            layer.attn_out_norm is not None or layer.mlp_out_norm is not None for layer in layers
        )
        for target, layer in zip(self._layers, layers, strict=True):
            target.input_norm = self._address(layer.input_norm)
            target.post_norm = self._address(layer.post_norm)
            if layer.q_norm is not None or layer.k_norm is not None:
                target.q_norm = self._head_norm(layer.q_norm)
                target.k_norm = self._head_norm(layer.k_norm)
            if layer.attn_out_norm is not None or layer.mlp_out_norm is not None:
                target.attn_out_norm = self._out_norm(layer.attn_out_norm)
                target.mlp_out_norm = self._out_norm(layer.mlp_out_norm)
            if layer.cos_sin is not None:
                table = self._float(layer.cos_sin)
                if table.shape != self.cos_sin.shape:
                    raise ValueError(
                        f"a layer's RoPE table of shape {tuple(table.shape)}, not the "
                        f"model's {tuple(self.cos_sin.shape)}"
                    )
                target.cos_sin = table.data_ptr()
            if layer.window < 0:
                raise ValueError(f"a sliding window of {layer.window} keys")
            target.window = layer.window
            if not 0.0 <= layer.softcap < float("inf"):
                raise ValueError(f"an attention soft-cap of {layer.softcap} (0: none)")
            target.softcap = layer.softcap
            self._fill(target.qkv, layer.qkv)
            self._fill(target.o_proj, layer.o_proj)
            self._fill(target.gate_up, layer.gate_up)
            self._fill(target.down, layer.down)
        self._model = _Model(
            num_layers=len(layers),
            hidden=shape.hidden,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            inter=shape.intermediate,
            rope_rows=rope_rows,
            eps=shape.rms_norm_eps,
            scale=shape.scale,
            cos_sin=self.cos_sin.data_ptr(),
            final_norm=self._address(final_norm),
            layers=self._layers,
            gelu=int(shape.gelu),
        )
        self._caches: tuple[int, ...] = ()
        self._kv_dtype = torch.float32

    def _float(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to(torch.float32).contiguous()
        self._keep.append(tensor)
        return tensor

    def _address(self, tensor: torch.Tensor) -> int:
        return int(self._float(tensor).data_ptr())

    def _head_norm(self, norm: torch.Tensor | None) -> int:
        """The address of a per-head q or k norm's weights (both or neither: Qwen3)."""
        if norm is None or tuple(norm.shape) != (self.shape.head_dim,):
            shape = None if norm is None else tuple(norm.shape)
            raise ValueError(f"q and k norms must both be [{self.shape.head_dim}], not {shape}")
        return self._address(norm)

    def _out_norm(self, norm: torch.Tensor | None) -> int:
        """The address of a sandwich norm's weights (both a layer's or neither: Gemma 3)."""
        if norm is None or tuple(norm.shape) != (self.shape.hidden,):
            shape = None if norm is None else tuple(norm.shape)
            raise ValueError(f"sandwich norms must both be [{self.shape.hidden}], not {shape}")
        return self._address(norm)

    def _fill(self, target: _Linear, projection: ProjectionParts) -> None:
        if not 1 <= len(projection.parts) <= MAX_PARTS:
            raise ValueError(f"a projection of {len(projection.parts)} parts (1..{MAX_PARTS})")
        bias = None if projection.bias is None else self._float(projection.bias)
        start = 0
        for slot, part in zip(target.parts, projection.parts, strict=False):
            data = part.data.contiguous()
            self._keep.append(data)
            rows = part.shape[0]
            slot.data = data.data_ptr()
            slot.bias = None if bias is None else bias.data_ptr() + 4 * start
            slot.row_bytes = data.shape[1]
            slot.rows = rows
            slot.fmt = part.format.code
            slot.interleaved = int(part.interleaved)
            start += rows
        target.num_parts = len(projection.parts)

    def bind_caches(
        self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]
    ) -> None:
        """Point every layer at its [S, kv_heads, head_dim] K/V pool, float32, float16 or
        bfloat16, or int8 [S, kv_heads, head_dim + 2] (kv_int8_ref.py) (once; again only when
        the pool's tensors change)."""
        key = tuple(t.data_ptr() for t in (*k_caches, *v_caches))
        if key == self._caches:
            return
        s = self.shape
        for layer, k, v in zip(self._layers, k_caches, v_caches, strict=True):
            for cache in (k, v):
                if (
                    cache.dtype != k_caches[0].dtype
                    or cache.dtype not in KV_DTYPES
                    or not cache.is_contiguous()
                    or tuple(cache.shape[1:])
                    != (s.num_kv_heads, pool_row(s.head_dim, k_caches[0].dtype))
                ):
                    raise ValueError(
                        f"KV caches must be contiguous float32, float16, bfloat16 or int8 "
                        f"[S, {s.num_kv_heads}, {s.head_dim} (+ 2 int8 scale bytes)], all of one "
                        "dtype"
                    )
            layer.k_cache = k.data_ptr()
            layer.v_cache = v.data_ptr()
        self._caches = key
        self._kv_dtype = k_caches[0].dtype

    def step(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        max_position: int | None = None,
        lora: StepLora | None = None,
    ) -> torch.Tensor:
        """hidden [n, hidden] float32 or bfloat16 (the embedded tokens, one per request) -> the
        final-normed hidden states [n, hidden] in hidden's dtype; each request's new K/V lands at its slot of the bound pool.
        positions/slots int64 [n]; block_table int32 [n, pages]; seq_lens int32 [n] (keys
        including the new one); ``max_position``: the largest position where the caller knows
        it (else read from ``positions``); ``lora``: the rows' adapters (decode_step_lora.py)."""
        if not self._caches:
            raise RuntimeError("bind_caches first")
        lib = _library(self._kv_dtype)
        if lib is None:
            raise RuntimeError("the native decode step library is not available")
        n = hidden.shape[0]
        dtype = hidden.dtype
        if dtype not in HIDDEN_DTYPES or tuple(hidden.shape) != (n, self.shape.hidden):
            raise ValueError(f"hidden must be float32 or bfloat16 [n, {self.shape.hidden}]")
        if max_position is None:
            max_position = int(positions.max()) if n else 0
        if max_position >= self.cos_sin.shape[0]:
            raise ValueError("a position lies past the rotary table")
        # as they come from build_forward_batch: no conversion, no torch call (a batch-1 step
        # runs this with every cache line cold, ~20-50 us a torch call)
        hidden = _as(hidden, torch.float32)
        positions = _as(positions, torch.int64)
        slots = _as(slots, torch.int64)
        table = _as(block_table, torch.int32)
        lens = _as(seq_lens, torch.int32)
        if lora is not None and lora.num_rows != n:
            raise ValueError(f"LoRA rows for {lora.num_rows} rows, not {n}")
        if lora is not None and not self.takes_lora:
            raise ValueError("LoRA rows of a model with sandwich norms take the torch path")
        out = torch.empty((n, self.shape.hidden), dtype=torch.float32)
        self._model.lora = None if lora is None else ctypes.pointer(lora.desc)
        status = lib.asyncengine_decode_step_planned(
            ctypes.byref(self._model),
            hidden.data_ptr(),
            n,
            positions.data_ptr(),
            slots.data_ptr(),
            table.data_ptr(),
            table.shape[1] if table.dim() == 2 else 0,
            lens.data_ptr(),
            page_size,
            out.data_ptr(),
            torch.get_num_threads(),
            plan_threads(),
        )
        self._model.lora = None
        if status != 0:
            raise MemoryError("the native decode step could not allocate its buffers")
        return out if dtype == torch.float32 else out.to(dtype)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor as a contiguous tensor of dtype: itself where it is one already."""
    if tensor.dtype == dtype and tensor.is_contiguous():
        return tensor
    return tensor.to(dtype).contiguous()


def group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The fused step's attention phase alone (kernels/cpu/cpu_group_attention.h), for its tests:
    q [n, heads, head_dim] float32 (rotated), the [S, kv_heads, head_dim] float32, float16 or
    bfloat16 pool, block table int32 [n, pages], seq_lens int32 [n] -> [n, heads, head_dim];
    ``window``: the last keys each row sees (a sliding layer's), 0: all; ``softcap``: the scaled
    scores' soft-cap (Gemma 2's), 0: none."""
    lib = _library(k_cache.dtype)
    if lib is None:
        raise RuntimeError("the native decode step library is not available")
    for cache in (k_cache, v_cache):
        if (
            cache.dtype != k_cache.dtype
            or cache.dtype not in KV_DTYPES
            or not cache.is_contiguous()
        ):
            raise ValueError(
                "the pool must be contiguous float32, float16, bfloat16 or int8 "
                "[S, kv_heads, head_dim]"
            )
    n, heads, head_dim = q.shape
    q = q.to(torch.float32).contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    status = lib.asyncengine_group_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        table.shape[1],
        lens.data_ptr(),
        n,
        heads,
        k_cache.shape[1],
        head_dim,
        page_size,
        scale,
        window,
        softcap,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"shape {tuple(q.shape)} over {tuple(k_cache.shape)} not supported")
    return out
