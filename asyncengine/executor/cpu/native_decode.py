"""Decode steps of a quantized (or float32) model in one native call (kernels/cpu/cpu_decode_step.c),
where the model and the batch allow it; ``LlamaModel.forward`` takes the torch path otherwise.

Which models: on a CPU, float32 or bfloat16 activations (a bfloat16 model's decode step runs in
float32 inside: its hidden states widened on the way in, rounded on the way out), a float32,
float16 or bfloat16 KV pool (the step's build for it: decode_step_native), every projection a
``QuantizedLinear`` (GGUF blocks, int8, or a float32 checkpoint's weights as F32 rows:
executor/layers/linear.py), the llama layer with what Qwen3 and Gemma 1/2/3 add to it or
without (per-head q/k norms before RoPE; sandwich norms, a GELU gate, sliding windows with their
own RoPE table, an attention soft-cap), and not deterministic mode (whose row blocks the torch
path keeps); LoRA rows of a model with sandwich norms take the torch path. Which batches:
decodes only, at most ``NATIVE_DECODE_MAX_ROWS`` of them (and fewer than the rows from which a
projection of the torch path leaves the group kernels for the dense, int8 or AMX product: 24
for F32, linear.py; a bfloat16 model's at most ``bf16_max_rows()``).
``ASYNCENGINE_NATIVE_DECODE=0`` keeps the torch path (to measure what the fused step gives)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import torch

from asyncengine.executor.attention.torch_backend import AttentionOptions
from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.executor.layers.linear import Linear, QuantizedLinear
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.kernels.cpu import decode_step_native, quant_amx_native
from asyncengine.kernels.cpu.decode_step_lora import StepLora
from asyncengine.kernels.cpu.decode_step_native import (
    DecodeShape,
    DecodeStepModel,
    LayerParts,
    ProjectionParts,
)

ENABLE_ENV = "ASYNCENGINE_NATIVE_DECODE"
# Decode batches up to this many requests take the fused step, and never as many as a projection
# of the model leaves the group kernels from (layers/linear.py's crossovers, per format); the cap
# keeps the step's per-thread buffers small. Measured by scripts/micro/bench_decode_step.py.
NATIVE_DECODE_MAX_ROWS = 256
# A bfloat16 model's decode batches take the fused step up to this many requests: past them its
# torch path (attention over the bfloat16 pool in AVX-512 BF16 dot products, where the fused
# step reads the pool 8 lanes at a time) is as fast or faster
# (scripts/micro/bench_decode_step.py --dtype bfloat16 --threads 1 --cpu-time).
BF16_NATIVE_DECODE_MAX_ROWS = 4
# On a CPU with AMX the fused step stays ahead further, while the torch path keeps the group
# kernels (fused / torch path, the embedded Q4_1 model in bfloat16 on the Xeon: context 443, one
# thread, CPU time: 4 / 6 / 8 / 12 rows 0.72 / 0.74 / 0.80 / 0.75; two threads, wall: 5-12 rows
# 0.63-0.77 at context 300, 0.68-0.78 at 4,000 over a bfloat16 pool, 0.65-0.75 at 300 and
# 0.83-0.87 at 4,000 over an int8 one, 1.02-1.03 at 16; a 1B Q4_K_M 0.87-0.90 at 1-8 rows,
# 0.89-0.96 at 9-12, 1.30 at 16: bench_decode_step.py --dtype bfloat16, bench_many_rows_step.py's
# model)
BF16_NATIVE_DECODE_MAX_ROWS_AMX = 12
# A speculative verify step of up to this many positions runs them as fused decode rows
# (runner.py; measured at batch 1); larger ones keep the extend path they were tuned with
# (speculative/settings.py).
VERIFY_DECODE_MAX_ROWS = 31


class LayerLike(Protocol):
    """What the fused step reads of a layer (executor/layers/model.py's LayerWeights)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
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
        or dtype not in decode_step_native.HIDDEN_DTYPES
        or row_block is not None
        or c.activation not in ("silu", "gelu_tanh")
        or c.head_dim > decode_step_native.MAX_HEAD_DIM
        or not decode_step_native.available()
    ):
        return None
    parts: list[LayerParts] = []
    for layer, table, options in zip(layers, cos_sin_tables, layer_options, strict=True):
        projections = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        if not all(
            isinstance(p, QuantizedLinear) and len(p.parts) <= decode_step_native.MAX_PARTS
            for p in projections
        ):
            return None
        qkv, o_proj, gate_up, down = (
            ProjectionParts(p.parts, p.bias) for p in projections if isinstance(p, QuantizedLinear)
        )
        parts.append(
            LayerParts(
                layer.input_norm,
                layer.post_norm,
                qkv,
                o_proj,
                gate_up,
                down,
                layer.q_norm,
                layer.k_norm,
                layer.attn_out_norm,
                layer.mlp_out_norm,
                options.window,
                None if table is cos_sin_tables[0] else table,
                options.softcap,
            )
        )
    shape = DecodeShape(
        hidden=c.hidden_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        scale=scale,
        gelu=c.activation == "gelu_tanh",
    )
    # the rows from which some projection of the torch path leaves the group kernels the fused
    # step runs (for another product: dense, int8 or AMX)
    leaves = min(
        p.group_kernels_below(dtype) if isinstance(p, QuantizedLinear) else 1 << 30
        for layer in layers
        for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    )
    most = leaves - 1 if dtype == torch.float32 else min(leaves - 1, bf16_max_rows())
    return DecodeStepModel(shape, parts, final_norm, cos_sin_tables[0], most)


def bf16_max_rows() -> int:
    """The most rows a bfloat16 model's fused step takes on this CPU."""
    if quant_amx_native.available():
        return BF16_NATIVE_DECODE_MAX_ROWS_AMX
    return BF16_NATIVE_DECODE_MAX_ROWS


def max_rows(model: DecodeStepModel | None) -> int:
    """The most decode rows a fused step of ``model`` is given (0: none)."""
    return 0 if model is None else min(NATIVE_DECODE_MAX_ROWS, model.max_rows)


def takes(model: DecodeStepModel, batch: ForwardBatch) -> bool:
    """Whether the fused step runs this batch: decodes only, few enough of them."""
    return batch.num_extends == 0 and 0 < batch.num_tokens <= max_rows(model)


def run(
    model: DecodeStepModel,
    batch: ForwardBatch,
    hidden: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    lora: StepLora | None = None,
) -> torch.Tensor:
    """The final-normed hidden states of the batch's sampled rows, as ``LlamaModel.forward``;
    ``lora``: the rows' adapters (native_decode_lora.py)."""
    model.bind_caches(k_caches, v_caches)
    out = model.step(
        hidden,
        batch.positions,
        batch.slot_mapping,
        batch.decode_block_table,
        batch.decode_seq_lens,
        batch.page_size,
        batch.decode_max_seq_len - 1,  # decodes only (takes): each row's kv length - 1
        lora,
    )
    if batch.sample_indices.shape[0] == batch.num_tokens:
        return out
    return out.index_select(0, batch.sample_indices)
