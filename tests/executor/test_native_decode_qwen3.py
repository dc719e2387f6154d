"""The fused native decode step on Qwen3 (kernels/cpu/cpu_decode_step.c): each q and k head
RMS-normed over head_dim by the layer's q_norm / k_norm before RoPE, as the torch path's
``_norm_qk`` and transformers' Qwen3Attention do. Against the torch path of the same weights on
the tiny Qwen3 (GQA 4 / 2, head_dim 24 where hidden / heads is 16, norms far from 1): float32
activations over Q8_0 blocks and over F32 rows, one row and three, and bfloat16 activations;
the K formats of a Q4_K_M file: test_native_decode_kquant.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from asyncengine.executor.layers.linear import Linear
from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.decode_step_native import (
    DecodeShape,
    DecodeStepModel,
    LayerParts,
    ProjectionParts,
)
from asyncengine.kernels.quant_formats import F32
from tests.conftest import TinyCheckpoint
from tests.executor.test_decode_step_bf16 import _assert_no_further_than, _teacher_forced
from tests.executor.test_native_decode import (
    PROMPTS,
    Pair,
    _compare,
    _count_fused_rows,
    _gguf_block,
)

pytestmark = pytest.mark.skipif(
    not cpu_native.compiler_found(), reason="no C compiler: the native kernels cannot be built"
)
BF16 = torch.bfloat16


@pytest.fixture
def tiny_qwen3(tiny_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    ckpt = tiny_checkpoints["qwen3_qk_norm"]
    weights = ckpt.load_weights()
    norm = weights["model.layers.0.self_attn.q_norm.weight"]
    assert norm.shape == (24,) and float((norm - 1).abs().max()) > 0.1  # norms that show
    return ckpt


def q8_0_blocks(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every projection and the LM head as Q8_0 blocks, as a Q8_0 GGUF stores them."""
    return {
        name: _gguf_block(w, GGMLQuantizationType.Q8_0) if w.dim() == 2 else w
        for name, w in weights.items()
    }


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_qwen3_step_on_q8_0_blocks_follows_the_torch_path(
    tiny_qwen3: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """Same logits within the int8 activations' rounding, same greedy tokens, the same normed
    and rotated K at the same slots; every decode step fused (one row: the new key normed in
    registers, no store phase)."""
    pair = Pair(tiny_qwen3, q8_0_blocks(tiny_qwen3.load_weights()))
    assert pair.config.qk_norm and pair.native.model.layers[0].q_norm is not None
    rows = _count_fused_rows(pair.native, monkeypatch)
    _compare(pair, steps=12, prompts=prompts)
    assert rows == [len(prompts)] * 12


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_float32_qwen3_step_on_f32_rows_follows_the_dense_torch_path(
    tiny_qwen3: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """No activation quantized on either side: the fused step's logits are the oneDNN torch
    path's within float32 summation order (a norm dropped, applied after RoPE or to v moves
    them by far more)."""
    pair = Pair(tiny_qwen3, tiny_qwen3.load_weights(), dense_reference=monkeypatch)
    qkv = pair.native.model.layers[0].qkv
    assert [part.format for part in qkv.parts] == [F32]  # type: ignore[union-attr]
    assert isinstance(pair.torch_path.model.layers[0].qkv, Linear)
    rows = _count_fused_rows(pair.native, monkeypatch)
    _compare(pair, steps=8, prompts=prompts, tolerance=1e-4, int8_activations=False)
    assert rows == [len(prompts)] * 8


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_bfloat16_qwen3_decodes_through_the_step(
    tiny_qwen3: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """bfloat16 activations over Q8_0 blocks: every decode fused (float32 inside, the q/k norms
    too, where the torch path rounds their outputs to bfloat16), no further from the float32
    model's logits than the bfloat16 torch path, and its greedy tokens the float32 model's
    wherever that model's top two logits stand further apart than the bfloat16 paths stray."""
    weights = q8_0_blocks(tiny_qwen3.load_weights())
    pair = Pair(tiny_qwen3, weights, dtype=BF16)
    rows = _count_fused_rows(pair.native, monkeypatch)
    fused = _teacher_forced(pair.native, prompts, 8)
    assert rows == [len(prompts)] * 8
    torch_path = _teacher_forced(pair.torch_path, prompts, 8)
    reference = _teacher_forced(Pair(tiny_qwen3, weights).torch_path, prompts, 8)
    assert all(torch.isfinite(step).all() for step in fused)
    _assert_no_further_than(fused, torch_path, reference)
    clear = 0
    for got, want in zip(fused, reference, strict=True):
        top2 = want.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        stray = (got - want).abs().max(dim=-1).values
        sure = margin > 2 * stray  # no bfloat16 rounding of this size can swap the two
        clear += int(sure.sum())
        assert got.argmax(-1)[sure].tolist() == want.argmax(-1)[sure].tolist()
    assert clear >= 2 * len(prompts)  # a quarter of the (step, row) pairs at least


def test_a_qwen3_layer_is_refused_with_one_norm_or_a_wrong_width(
    tiny_qwen3: TinyCheckpoint,
) -> None:
    """The step takes q and k norms together, each [head_dim]: anything else is a clear error
    rather than a read past the weights."""
    model = Pair(tiny_qwen3, q8_0_blocks(tiny_qwen3.load_weights())).native.model
    layer, c = model.layers[0], model.config
    assert layer.q_norm is not None and layer.k_norm is not None
    shape = DecodeShape(
        c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, 1e-6, 0.2
    )
    projections = [
        ProjectionParts(p.parts, p.bias)  # type: ignore[union-attr]
        for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    ]
    rope = torch.zeros(8, c.head_dim)

    def step_model(q_norm: torch.Tensor | None, k_norm: torch.Tensor | None) -> DecodeStepModel:
        parts = LayerParts(layer.input_norm, layer.post_norm, *projections, q_norm, k_norm)
        return DecodeStepModel(shape, [parts], model.norm, rope)

    step_model(layer.q_norm, layer.k_norm)
    step_model(None, None)  # the plain llama layer
    for q_norm, k_norm in [
        (layer.q_norm, None),
        (None, layer.k_norm),
        (layer.q_norm, torch.ones(c.head_dim + 1)),
    ]:
        with pytest.raises(ValueError, match="q and k norms"):
            step_model(q_norm, k_norm)
