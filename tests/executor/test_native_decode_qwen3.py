"""The fused native decode step on Qwen3 (kernels/cpu/cpu_decode_step.c): each q and k head
RMS-normed over head_dim by the layer's q_norm / k_norm before RoPE, as the torch path's
``_norm_qk`` and transformers' Qwen3Attention do. Against the torch path of the same weights on
the tiny Qwen3 (GQA 4 / 2, head_dim 24 where hidden / heads is 16, norms far from 1): float32
activations over Q8_0 blocks and over F32 rows, one row and three, and bfloat16 activations;
the K formats of a Q4_K_M file: test_native_decode_kquant.py."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu.decode_step_native import (
    DecodeShape,
    DecodeStepModel,
    LayerParts,
    ProjectionParts,
)
from tests.conftest import TinyCheckpoint
from tests.executor.fused_step_checks import (
    check_bf16_step,
    check_f32_step,
    check_q8_0_step,
    q8_0_blocks,
)
from tests.executor.test_native_decode import (
    PROMPTS,
    Pair,
)
from tests.native_support import needs_native

pytestmark = needs_native


@pytest.fixture
def tiny_qwen3(tiny_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    ckpt = tiny_checkpoints["qwen3_qk_norm"]
    weights = ckpt.load_weights()
    norm = weights["model.layers.0.self_attn.q_norm.weight"]
    assert norm.shape == (24,) and float((norm - 1).abs().max()) > 0.1  # norms that show
    return ckpt


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_qwen3_step_on_q8_0_blocks_follows_the_torch_path(
    tiny_qwen3: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """The normed and rotated K at the same slots too (one row: the new key normed in
    registers, no store phase)."""
    pair = check_q8_0_step(tiny_qwen3, monkeypatch, prompts, steps=12)
    assert pair.config.qk_norm and pair.native.model.layers[0].q_norm is not None


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_float32_qwen3_step_on_f32_rows_follows_the_dense_torch_path(
    tiny_qwen3: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """A norm dropped, applied after RoPE or to v moves the logits by far more than float32
    summation order."""
    check_f32_step(tiny_qwen3, monkeypatch, prompts, steps=8)


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_bfloat16_qwen3_decodes_through_the_step(
    tiny_qwen3: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """The q/k norms in float32 too, where the torch path rounds their outputs to bfloat16."""
    check_bf16_step(tiny_qwen3, monkeypatch, prompts, steps=8)


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
