"""The llama-family causal LM (Llama, Qwen2, Qwen3, Mistral, Gemma 1/2/3) as a forward over the
paged KV pool.

Plain tensors and functions, no nn.Module: each layer is ~15 torch calls. At load time q/k/v
are fused into one projection and gate/up into another (fewer, larger matmuls), and on a CPU
every projection's weight is prepacked for oneDNN once (executor/layers/linear.py). The families
differ in three hooks read from the ModelConfig: Gemma's ``(1 + w)`` norms become plain norms
at load time (the offset is added to the weights), Qwen3's per-head q/k norms run before RoPE
(``_norm_qk``), and the MLP activation and embedding multiplier are picked once. Gemma 2/3 add
norms on the attention and MLP outputs (``attn_out_norm``, ``mlp_out_norm``), their own
attention scale, per-layer attention options (sliding window, soft-cap: ``AttentionOptions``),
per-layer RoPE tables (Gemma 3's sliding layers) and a soft-cap on the final logits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from asyncengine.executor.attention.selector import KernelOps, kernel_ops
from asyncengine.executor.attention.torch_backend import AttentionBackend, AttentionOptions
from asyncengine.executor.cpu import native_decode, weight_arena
from asyncengine.executor.cpu.native_decode_lora import NativeDecodeLora
from asyncengine.executor.cpu.weight_pack import write_pending
from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.executor.layers.linear import (
    F32_HEAD_DENSE_FROM_ROWS,
    DenseBudget,
    Linear,
    QuantizedLinear,
    make_linear,
)
from asyncengine.executor.layers.model_config import ModelConfig, RopeScaling
from asyncengine.executor.layers.rope import build_cos_sin_cache
from asyncengine.kernels.cpu import layer_ops_native
from asyncengine.kernels.cpu.quant_native import dequantize_rows
from asyncengine.kernels.quant_formats import QuantizedTensor
from asyncengine.kernels.reference import rotary_ref
from asyncengine.kernels.reference.activation_ref import gelu_tanh_and_mul
from asyncengine.kernels.reference.attention_window import soft_cap
from asyncengine.kernels.reference.kv_store_ref import copy_kv_slots, store_kv

if TYPE_CHECKING:
    from asyncengine.executor.lora.lora_step import LoraStep


# A CPU forward runs the MLP over equal row chunks whose gate/up output stays within glibc's
# largest mmap threshold (32 MiB on 64-bit): a block above it is a fresh mapping each time, faulted
# in page by page (a 1,024-token step of a 1.5B model: a 36 MB output a layer, ~0.9M page faults
# per 2,048 prompt tokens); below it malloc reuses the memory freed layer after layer. Prompt
# steps up to 1.2x faster there (as often as the allocator's state made the whole rows fault;
# scripts/micro/bench_prompt_faults.py), the 32-concurrent run 1.03-1.10x.
MLP_CHUNK_BYTES = 32 << 20


class WeightsError(ValueError):
    """The weights do not fit the config (a tensor missing or of the wrong shape)."""


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear | QuantizedLinear  # [q_size + 2 * kv_size, hidden], with q/k/v biases if any
    o_proj: Linear | QuantizedLinear  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden], the norm before the MLP
    gate_up: Linear | QuantizedLinear  # [2 * intermediate, hidden]
    down: Linear | QuantizedLinear  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim] (Qwen3)
    attn_out_norm: torch.Tensor | None = None  # [hidden] (Gemma 2/3: before the residual add)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] (Gemma 2/3: before the residual add)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor | QuantizedTensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: KernelOps | None = None,
        row_block: int | None = None,
        dense_weight_bytes: int | None = None,
        defer_huge_pages: bool = False,
        max_positions: int | None = None,
        consume_weights: bool = False,
    ) -> None:
        """``row_block``: every matmul runs on blocks of this many rows (deterministic mode,
        executor/layers/linear.py); None: one call per matmul. Weights given as QuantizedTensor (a GGUF's
        blocks, or int8) stay quantized: their projections run the quantized kernels and a
        quantized embedding is dequantized a looked-up row at a time. ``dense_weight_bytes``: what
        the dense copies of quantized projections may take together (layers/linear.py's
        ``DenseBudget``; None: no limit). ``defer_huge_pages``: the quantized weights written in
        plain pages, moved into huge pages by ``defer_huge_pages()``'s calls (the engine's, after
        start-up: executor/cpu/weight_arena.py). ``max_positions``: the longest sequence the
        caller's KV pages can hold (the RoPE tables' length; None: the model's context).
        ``consume_weights``: each weight taken leaves ``weights``, so that a checkpoint's tensor
        is freed once its packed copy is written, not held beside the whole packed model."""
        self.config = config
        self.row_block = row_block
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops = ops if ops is not None else kernel_ops("torch")
        # The torch reference rotary gets its cos/sin rows once per forward and rotates q and k
        # (adjacent in the qkv output) in one call; other kernels take the contract's arguments.
        self.rotary_once_per_forward = self.ops.apply_rotary is rotary_ref.apply_rotary
        take = _WeightTaker(weights, dtype, self.device, consume_weights)
        self.dense_budget = None if dense_weight_bytes is None else DenseBudget(dense_weight_bytes)
        # the quantized weights in the order a decode step reads them (the order they are
        # made in below: each layer's qkv, o_proj, gate_up, down, then the LM head), in huge pages
        self._weight_arena = (
            weight_arena.arena_for(weights.values(), defer_huge_pages)
            if self.device.type == "cpu"
            else None
        )
        c = config
        self.embed = take.any("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = [self._load_layer(take, i) for i in range(c.num_layers)]
        self.norm = take("model.norm.weight", (c.hidden_size,), c.norm_weight_offset)
        # Gemma scales embeddings by sqrt(hidden) rounded to the model's dtype first, as HF
        self.embedding_multiplier = (
            None
            if c.embedding_multiplier is None
            else float(torch.tensor(c.embedding_multiplier, dtype=dtype))
        )
        # The Triton twins cover SwiGLU; GeGLU runs its torch reference on either device.
        self.act_and_mul = self.ops.silu_and_mul if c.activation == "silu" else gelu_tanh_and_mul
        # the int8 product reproduces the native SwiGLU's values (not the references')
        self.fused_silu = self.act_and_mul is layer_ops_native.silu_and_mul
        head = (
            self.embed
            if c.tie_word_embeddings
            else take.any("lm_head.weight", (c.vocab_size, c.hidden_size))
        )
        self.lm_head = make_linear(
            [head],
            None,
            dtype,
            row_block,
            F32_HEAD_DENSE_FROM_ROWS,
            self._weight_arena,
            self.dense_budget,
        )
        if self._weight_arena is not None:  # every projection made: their bytes, in one pass
            write_pending(self._weight_arena)
        if head is self.embed and isinstance(self.lm_head, QuantizedLinear):
            # one copy of a tied table: the head's (possibly interleaved) one serves lookups too
            self.embed = self.lm_head.parts[0]
        # a row per position a sequence can reach: a table of the model's 128k positions costs a
        # 3B's start 0.1-0.2 s, and a 2k-token engine reads 2k of them
        positions = min(c.max_model_len, max_positions or c.max_model_len)
        self.cos_sin_cache = build_cos_sin_cache(config, positions).to(self.device)
        # each layer's RoPE table: Gemma 3's sliding layers have their own base
        self.layer_cos_sin = [self.cos_sin_cache] * c.num_layers
        if c.sliding_rope_theta is not None:
            scaling = c.sliding_rope_scaling or RopeScaling()
            local = replace(c, rope_theta=c.sliding_rope_theta, rope_scaling=scaling)
            local_cache = build_cos_sin_cache(local, positions).to(self.device)
            for i in range(c.num_layers):
                if c.layer_window(i):
                    self.layer_cos_sin[i] = local_cache
        self.scale = c.attention_scale if c.attention_scale is not None else c.head_dim**-0.5
        self.layer_options = [
            AttentionOptions(c.layer_window(i), c.attn_logit_softcap) for i in range(c.num_layers)
        ]
        self.gate_up_row_bytes = 2 * c.intermediate_size * dtype.itemsize  # ``_mlp``'s chunks
        # decode batches of a quantized model in one native call where it can run (None: never)
        self.native_decode = native_decode.native_decode_model(
            c,
            self.layers,
            self.norm,
            self.layer_cos_sin,
            self.layer_options,
            self.scale,
            dtype,
            self.device,
            row_block,
        )
        # the adapters' tables for LoRA rows in that native call (None: LoRA rows never take it)
        self.native_decode_lora = (
            None
            if self.native_decode is None or not self.native_decode.takes_lora
            else NativeDecodeLora(self.native_decode.shape, c.num_layers)
        )

    def _load_layer(self, take: _WeightTaker, i: int) -> LayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        qkv = [
            take.any(p + "self_attn.q_proj.weight", (q, h)),
            take.any(p + "self_attn.k_proj.weight", (kv, h)),
            take.any(p + "self_attn.v_proj.weight", (kv, h)),
        ]
        qkv_bias = None
        if c.attention_bias:
            qkv_bias = torch.cat(
                [
                    take(p + "self_attn.q_proj.bias", (q,)),
                    take(p + "self_attn.k_proj.bias", (kv,)),
                    take(p + "self_attn.v_proj.bias", (kv,)),
                ]
            )
        gate_up = [
            take.any(p + "mlp.gate_proj.weight", (inter, h)),
            take.any(p + "mlp.up_proj.weight", (inter, h)),
        ]
        offset = c.norm_weight_offset
        attn_out_norm = mlp_out_norm = None
        post_norm_name = "post_attention_layernorm"
        if c.sandwich_norms:
            attn_out_norm = take(p + "post_attention_layernorm.weight", (h,), offset)
            mlp_out_norm = take(p + "post_feedforward_layernorm.weight", (h,), offset)
            post_norm_name = "pre_feedforward_layernorm"
        q_norm = k_norm = None
        if c.qk_norm:
            q_norm = take(p + "self_attn.q_norm.weight", (c.head_dim,), offset)
            k_norm = take(p + "self_attn.k_norm.weight", (c.head_dim,), offset)
        return LayerWeights(
            input_norm=take(p + "input_layernorm.weight", (h,), offset),
            qkv=self._linear(qkv, qkv_bias),
            o_proj=self._linear([take.any(p + "self_attn.o_proj.weight", (h, q))]),
            post_norm=take(p + post_norm_name + ".weight", (h,), offset),
            gate_up=self._linear(gate_up),
            down=self._linear([take.any(p + "mlp.down_proj.weight", (h, inter))]),
            q_norm=q_norm,
            k_norm=k_norm,
            attn_out_norm=attn_out_norm,
            mlp_out_norm=mlp_out_norm,
        )

    def _linear(
        self, parts: list[torch.Tensor | QuantizedTensor], bias: torch.Tensor | None = None
    ) -> Linear | QuantizedLinear:
        return make_linear(
            parts,
            bias,
            self.dtype,
            self.row_block,
            arena=self._weight_arena,
            budget=self.dense_budget,
        )

    def linears(self) -> list[Linear | QuantizedLinear]:
        """Every projection, in the order a step reads them: each layer's, then the LM head."""
        return [
            *(
                p
                for layer in self.layers
                for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            ),
            self.lm_head,
        ]

    def build_i8_every_row(self) -> None:
        """Deterministic mode's int8 panels (linear.py's ``i8_every_row``) built whole now, from
        the written weights: the runner calls it at start-up with every thread (else each
        projection's first call builds its own, in the first request)."""
        for linear in self.linears():
            if isinstance(linear, QuantizedLinear):
                linear.build_i8_every_row()

    def defer_panels(self) -> Callable[[], bool] | None:
        """The int8 panels of every projection that takes that product (linear.py), built a row
        range per call of the function returned (True while any remain), in step order, rather
        than whole by each projection's first many-row call; None: none to build. The calls
        and the forwards must come from one thread (the engine's worker: between steps)."""
        deferred = deque(
            p for p in self.linears() if isinstance(p, QuantizedLinear) and p.defer_i8(self.dtype)
        )
        if not deferred:
            return None

        def step() -> bool:
            while deferred and not deferred[0].i8_deferred:  # built by a forward meanwhile
                deferred.popleft()
            if deferred:
                deferred[0].build_i8_step()
            while deferred and not deferred[0].i8_deferred:
                deferred.popleft()
            return bool(deferred)

        return step

    def deferred_huge_pages(self) -> Callable[[], bool] | None:
        """The quantized weights' move into huge pages, a few MiB per call of the function
        returned (True while more remain; ``WeightArena.huge_pages_step``); None: nothing left
        to move. Calls from the thread that runs the forwards, between them."""
        arena = self._weight_arena
        return arena.huge_pages_step if arena is not None and arena.huge_pages_deferred else None

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedTensor):
            return dequantize_rows(self.embed, input_ids, self.dtype)
        return F.embedding(input_ids, self.embed)

    def forward(
        self,
        batch: ForwardBatch,
        backend: AttentionBackend,
        metadata: object,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        rows: torch.Tensor | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Run every layer over the batch's tokens; return the final-normed hidden states of the
        sampled rows, then the scored ones (``batch.hidden_rows``), [rows, hidden] (``rows`` of the
        flat tokens instead, when given). ``lora``: LoRA updates added to the rows of their
        adapters after each projection (the fused decode step has no such hook: not taken)."""
        c = self.config
        ops = self.ops
        n = batch.num_tokens
        eps = c.rms_norm_eps
        split = [c.q_size, c.kv_size, c.kv_size]
        positions = batch.positions
        qk_heads = c.num_heads + c.num_kv_heads
        # cos/sin rows of each distinct RoPE table, once per forward (torch reference rotary)
        rope_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.rotary_once_per_forward and self.ops.rotary_store is None:
            for table in self.layer_cos_sin:
                if id(table) not in rope_rows:
                    rope_rows[id(table)] = rotary_ref.cos_sin_for_positions(
                        positions, table, self.dtype
                    )
        hidden = self.embed_tokens(batch.input_ids)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        if (
            self.native_decode is not None
            and batch.kv_copies is None
            and native_decode.takes(self.native_decode, batch)
        ):
            fused_lora = None
            if lora is not None and self.native_decode_lora is not None:
                fused_lora = self.native_decode_lora.step_rows(lora, batch.num_tokens)
            if lora is None or fused_lora is not None:
                return native_decode.run(
                    self.native_decode, batch, hidden, k_caches, v_caches, lora=fused_lora
                )
        if rows is None:
            rows = batch.hidden_rows
        # the last layer's o_proj and MLP run only on the rows kept (a prompt's last one; the
        # K/V of every row is stored before): LoRA's updates index the whole batch's rows
        prune_at = len(self.layers) - 1 if lora is None and rows.shape[0] < n else -1
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            cos_sin, options = self.layer_cos_sin[i], self.layer_options[i]
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, eps)
            else:
                x, residual = ops.fused_add_rms_norm(hidden, residual, layer.input_norm, eps)
            qkv = layer.qkv(x)
            if lora is not None:
                lora.apply(i, "qkv", x, qkv)
            if layer.q_norm is not None:
                qkv = self._norm_qk(qkv, layer)
            if ops.rotary_store is not None:  # native CPU kernels: rotate and store in one pass
                q = ops.rotary_store(
                    qkv,
                    c.num_heads,
                    c.num_kv_heads,
                    positions,
                    cos_sin,
                    k_caches[i],
                    v_caches[i],
                    batch.slot_mapping,
                )
                if batch.kv_copies is not None:
                    copy_kv_slots(k_caches[i], v_caches[i], batch.kv_copies)
                attn = backend.attend(q, k_caches[i], v_caches[i], metadata, self.scale, options)
            else:
                if rope_rows:
                    cos, sin = rope_rows[id(cos_sin)]
                    qk = rotary_ref.rotate_neox(
                        qkv[:, : c.q_size + c.kv_size].view(n, qk_heads, c.head_dim), cos, sin
                    )
                    q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
                    v = qkv[:, c.q_size + c.kv_size :]
                else:
                    q, k, v = qkv.split(split, dim=-1)
                    q, k = ops.apply_rotary(
                        q.view(n, c.num_heads, c.head_dim),
                        k.view(n, c.num_kv_heads, c.head_dim),
                        positions,
                        cos_sin,
                    )
                v = v.view(n, c.num_kv_heads, c.head_dim)
                if batch.kv_copies is not None:
                    # the copies read this forward's K/V: store it first (the backend stores
                    # it again, the same values) and copy before the backend attends
                    store_kv(k_caches[i], v_caches[i], k, v, batch.slot_mapping)
                    copy_kv_slots(k_caches[i], v_caches[i], batch.kv_copies)
                attn = backend.forward(
                    q, k, v, k_caches[i], v_caches[i], metadata, self.scale, options
                )
            attn_out = attn.reshape(n, c.q_size)
            if i == prune_at:
                attn_out, residual = attn_out.index_select(0, rows), residual.index_select(0, rows)
            hidden = layer.o_proj(attn_out)
            if lora is not None:
                lora.apply(i, "o_proj", attn_out, hidden)
            if layer.attn_out_norm is not None:
                hidden = ops.rms_norm(hidden, layer.attn_out_norm, eps)
            x, residual = ops.fused_add_rms_norm(hidden, residual, layer.post_norm, eps)
            if lora is None:
                hidden = self._mlp(layer, x)
            else:
                gate_up = layer.gate_up(x)
                lora.apply(i, "gate_up", x, gate_up)
                act = self.act_and_mul(gate_up)
                hidden = layer.down(act)
                lora.apply(i, "down", act, hidden)
            if layer.mlp_out_norm is not None:
                hidden = ops.rms_norm(hidden, layer.mlp_out_norm, eps)
        assert residual is not None
        if prune_at < 0:
            hidden, residual = hidden.index_select(0, rows), residual.index_select(0, rows)
        return ops.rms_norm(hidden + residual, self.norm, eps)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate_up(x))); on the CPU over equal row chunks whose gate/up output stays
        within ``MLP_CHUNK_BYTES`` (the rows are independent)."""
        n = x.shape[0]
        chunks = -(-n * self.gate_up_row_bytes // MLP_CHUNK_BYTES)
        if chunks <= 1 or self.device.type != "cpu":
            return self._down(layer, layer.gate_up(x))
        step = -(-n // chunks)
        out = torch.empty((n, self.config.hidden_size), dtype=x.dtype, device=x.device)
        for start in range(0, n, step):
            rows = x[start : start + step]
            out[start : start + rows.shape[0]] = self._down(layer, layer.gate_up(rows))
        return out

    def _down(self, layer: LayerWeights, gate_up: torch.Tensor) -> torch.Tensor:
        """down(act(gate_up)); the native SwiGLU made inside a quantized down projection's
        product where it takes one (``QuantizedLinear.silu_and_mul_product``)."""
        if self.fused_silu and isinstance(layer.down, QuantizedLinear) and gate_up.dim() == 2:
            return layer.down.silu_and_mul_product(gate_up, self.act_and_mul)
        return layer.down(self.act_and_mul(gate_up))

    def _norm_qk(self, qkv: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """qkv with each q and k head RMS-normed over head_dim (Qwen3), v untouched."""
        assert layer.q_norm is not None and layer.k_norm is not None
        c = self.config
        n, eps, d = qkv.shape[0], c.rms_norm_eps, c.head_dim
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = self.ops.rms_norm(q.reshape(-1, d), layer.q_norm, eps).view(n, c.q_size)
        k = self.ops.rms_norm(k.reshape(-1, d), layer.k_norm, eps).view(n, c.kv_size)
        return torch.cat([q, k, v], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden] -> float32 logits [num_sampled, vocab]."""
        if isinstance(self.lm_head, QuantizedLinear) and hidden.dim() == 2:
            logits = self.lm_head.float32_out(hidden)
        else:
            logits = self.lm_head(hidden)
        if logits.dtype != torch.float32:
            logits = logits.float()
        cap = self.config.final_logit_softcap
        return soft_cap(logits, cap) if cap else logits


class _WeightTaker:
    """Fetch an HF-named tensor, check its shape, move it to the model's dtype and device;
    ``consume``: take it out of ``weights``."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor | QuantizedTensor],
        dtype: torch.dtype,
        device: torch.device,
        consume: bool = False,
    ):
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.consume = consume

    def __call__(self, name: str, shape: tuple[int, ...], offset: float = 0.0) -> torch.Tensor:
        """``offset`` is added in float32 before the cast (Gemma's ``1 + w`` norm weights)."""
        tensor = self._get(name, shape)
        if isinstance(tensor, QuantizedTensor):  # a norm or bias is never kept quantized
            tensor = dequantize_rows(tensor, None)
        if offset:
            tensor = tensor.float() + offset
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def any(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedTensor:
        """The tensor as given: a QuantizedTensor stays quantized (a projection's weight, a
        quantized embedding); a dense one is moved to the model's dtype and device."""
        tensor = self._get(name, shape)
        if isinstance(tensor, QuantizedTensor):
            if self.device.type != "cpu":
                raise WeightsError(f"weight {name!r} is quantized: only the CPU has its kernels")
            return tensor
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def _get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedTensor:
        tensor = self.weights.pop(name, None) if self.consume else self.weights.get(name)
        if tensor is None:
            raise WeightsError(f"weight {name!r} is missing from the checkpoint")
        if tuple(tensor.shape) != shape:
            raise WeightsError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the config expects {shape}"
            )
        return tensor
