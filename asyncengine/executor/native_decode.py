"""Decode steps of a quantized model in one native call (kernels/cpu_decode_step.c), where the
model and the batch allow it; ``LlamaModel.forward`` takes the torch path otherwise.

Which models: on a CPU, float32 activations and KV pool, every projection quantized
(``QuantizedLinear``), the plain llama layer (SwiGLU, no per-head q/k norms, no sandwich norms,
one RoPE table, no sliding window or soft-cap) and not deterministic mode (whose row blocks
the torch path keeps). Which batches: decodes only, at most ``NATIVE_DECODE_MAX_ROWS`` of them.
``ASYNCENGINE_NATIVE_DECODE=0`` keeps the torch path (to measure what the fused step gives).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import torch

from asyncengine.executor.attention import AttentionOptions
from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.executor.linear import DENSE_FROM_ROWS, Linear, QuantizedLinear
from asyncengine.executor.model_config import ModelConfig
from asyncengine.kernels import decode_step_native
from asyncengine.kernels.decode_step_native import (
    DecodeShape,
    DecodeStepModel,
    LayerParts,
    ProjectionParts,
)

ENABLE_ENV = "ASYNCENGINE_NATIVE_DECODE"
# Decode batches up to this many requests take the fused step. It was never slower below 32
# (one thread's CPU time per step on SmolLM2's Q4_1 file, context 64, scripts/bench_decode_step.py
# --threads 1 --cpu-time, fused vs torch path: 17.3 vs 24.5 ms at 1 request, 38 vs 43 at 4, 67 vs
# 78 at 8, 201 vs 205 at 16, 205 vs 241 at 24, 282 vs 304 at 31; with interleaved rows 11.7-13.4
# vs 19-21 at 1, 24-25 vs 34-37 at 4, 71-75 vs 96-108 at 16) and even with the dense product
# from 32 rows (0.95-0.99x at 32-128): below DENSE_FROM_ROWS either way.
NATIVE_DECODE_MAX_ROWS = min(31, DENSE_FROM_ROWS - 1)


class LayerLike(Protocol):
    """What the fused step reads of a layer (executor/model.py's LayerWeights)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear | QuantizedLinear
    o_proj: Linear | QuantizedLinear
    gate_up: Linear | QuantizedLinear
    down: Linear | QuantizedLinear


def native_decode_model(
    config: ModelConfig,
    layers: Sequence[LayerLike],
    final_norm: torch.Tensor,
    cos_sin_tables: Sequence[torch.Tensor],
    layer_options: Sequence[AttentionOptions],
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
    row_block: int | None,
) -> DecodeStepModel | None:
    """The model as the fused decode step takes it, or None where it cannot run this model."""
    c = config
    if (
        os.environ.get(ENABLE_ENV, "1") == "0"
        or device.type != "cpu"
        or dtype != torch.float32
        or row_block is not None
        or c.activation != "silu"
        or c.qk_norm
        or c.sandwich_norms
        or any(t is not cos_sin_tables[0] for t in cos_sin_tables)
        or not all(o.plain for o in layer_options)
        or c.head_dim > decode_step_native.MAX_HEAD_DIM
        or not decode_step_native.available()
    ):
        return None
    parts: list[LayerParts] = []
    for layer in layers:
        projections = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        if not all(
            isinstance(p, QuantizedLinear) and len(p.parts) <= decode_step_native.MAX_PARTS
            for p in projections
        ):
            return None
        qkv, o_proj, gate_up, down = (
            ProjectionParts(p.parts, p.bias) for p in projections if isinstance(p, QuantizedLinear)
        )
        parts.append(LayerParts(layer.input_norm, layer.post_norm, qkv, o_proj, gate_up, down))
    shape = DecodeShape(
        hidden=c.hidden_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        scale=scale,
    )
    return DecodeStepModel(shape, parts, final_norm, cos_sin_tables[0])


def takes(batch: ForwardBatch) -> bool:
    """Whether the fused step runs this batch: decodes only, few enough of them."""
    return batch.num_extends == 0 and 0 < batch.num_tokens <= NATIVE_DECODE_MAX_ROWS


def run(
    model: DecodeStepModel,
    batch: ForwardBatch,
    hidden: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The final-normed hidden states of the batch's sampled rows, as ``LlamaModel.forward``."""
    model.bind_caches(k_caches, v_caches)
    out = model.step(
        hidden,
        batch.positions,
        batch.slot_mapping,
        batch.decode_block_table,
        batch.decode_seq_lens,
        batch.page_size,
    )
    if batch.sample_indices.shape[0] == batch.num_tokens:
        return out
    return out.index_select(0, batch.sample_indices)
