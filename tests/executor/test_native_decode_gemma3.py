"""The fused native decode step on Gemma 3 (kernels/cpu/cpu_decode_step.c): sandwich norms on the
attention and MLP outputs before their residual adds, a GELU (tanh) gate, per-head q/k norms,
the attention scale of query_pre_attn_scalar, and sliding layers that see their last 8 keys
only and rotate by a RoPE table of their own base (the full layer's linear-scaled). Against the
torch path of the same weights on the tiny Gemma 3 (conftest's "gemma3": 3 sliding layers of 4,
head_dim 64, GQA 4 / 2), decoded past the window: float32 activations over Q8_0 blocks and over
F32 rows, one row and three, and bfloat16 activations; the Q8_0 GGUF as llama.cpp's converter
writes it loads onto the step (Gemma 2's soft-caps: test_native_decode_gemma2.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncengine.executor.cpu import native_decode
from asyncengine.executor.layers.model_config import ModelConfig
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
    check_gguf_step,
    check_q8_0_step,
    q8_0_blocks,
    step_built_with,
)
from tests.executor.test_native_decode import (
    PROMPTS,
    Pair,
    _compare,
    _count_fused_rows,
)
from tests.native_support import needs_native

pytestmark = needs_native
WINDOW = 8  # conftest's "gemma3": every prompt's context passes it within the steps below
ROWS = [PROMPTS, PROMPTS[:1]]


@pytest.fixture(params=["native", "avx2"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The step's library as built for this CPU, or forced to AVX2 (-mno-avx512f: the 8-lane
    GELU, the attention's AVX2 loops over a window's keys)."""
    with step_built_with(("-mno-avx512f",) if request.param == "avx2" else None):
        yield request.param


@pytest.fixture
def tiny_gemma3(tiny_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    ckpt = tiny_checkpoints["gemma3"]
    c = ModelConfig.from_hf_dict(ckpt.hf_config)
    assert c.sandwich_norms and c.qk_norm and c.activation == "gelu_tanh"
    assert c.sliding_window == WINDOW and c.sliding_rope_theta is not None
    assert c.attention_scale != c.head_dim**-0.5  # query_pre_attn_scalar
    return ckpt


def _assert_gemma3_layers(pair: Pair) -> None:
    """The fused model holds what the torch path runs: sliding and full layers, their tables."""
    model = pair.native.model
    windows = [o.window for o in model.layer_options]
    assert windows == [WINDOW, 0, WINDOW, WINDOW]
    assert model.layer_cos_sin[0] is not model.layer_cos_sin[1]
    assert model.layers[0].attn_out_norm is not None and model.layers[0].q_norm is not None


@pytest.mark.parametrize("prompts", ROWS, ids=["3 rows", "1 row"])
def test_a_gemma3_step_on_q8_0_blocks_follows_the_torch_path(
    tiny_gemma3: TinyCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    prompts: list[list[int]],
    isa: str,
) -> None:
    """Contexts up to 23 keys over a window of 8 (a window ignored, a sandwich norm dropped,
    SiLU for GELU or the global table on a sliding layer each moves the logits by far more)."""
    _assert_gemma3_layers(check_q8_0_step(tiny_gemma3, monkeypatch, prompts, steps=12))


@pytest.mark.parametrize("prompts", ROWS, ids=["3 rows", "1 row"])
def test_a_float32_gemma3_step_on_f32_rows_follows_the_dense_torch_path(
    tiny_gemma3: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    check_f32_step(tiny_gemma3, monkeypatch, prompts, steps=10)


@pytest.mark.parametrize("prompts", ROWS, ids=["3 rows", "1 row"])
def test_a_bfloat16_gemma3_decodes_through_the_step(
    tiny_gemma3: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    check_bf16_step(tiny_gemma3, monkeypatch, prompts, steps=10)


def test_a_gemma_step_takes_the_gelu_gate(
    tiny_checkpoints: dict[str, TinyCheckpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 1 (GELU gate, (1 + w) norms, no sandwich norms or windows) is fused too."""
    ckpt = tiny_checkpoints["gemma"]
    pair = Pair(ckpt, q8_0_blocks(ckpt.load_weights()))
    rows = _count_fused_rows(pair.native, monkeypatch)
    _compare(pair, steps=8)
    assert rows == [len(PROMPTS)] * 8


def test_a_gemma3_q8_0_gguf_loads_onto_the_fused_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q8_0 GGUF of Gemma 3 as llama.cpp's converter writes it (five sliding layers to a full
    one, the sliding layers' own RoPE base, linear scaling on the full one, GQA 4:1): read as
    the engine reads it, its decode steps are fused and follow the torch path past the window
    of 16."""
    pair = check_gguf_step("gemma3_sliding_local_rope_linear", tmp_path, monkeypatch)
    assert [o.window for o in pair.native.model.layer_options] == [16] * 5 + [0]


def test_lora_rows_of_gemma3_keep_the_torch_path(
    tiny_checkpoints: dict[str, TinyCheckpoint], tiny_gemma3: TinyCheckpoint
) -> None:
    """A LoRA row of Gemma 3 would add its update where a sandwich norm needs the whole row
    first, so adapters take the torch path (the step refuses them), while Gemma 1 (GELU, no
    sandwich norms) is fused with them."""
    gemma3 = Pair(tiny_gemma3, q8_0_blocks(tiny_gemma3.load_weights())).native.model
    assert gemma3.native_decode is not None and not gemma3.native_decode.takes_lora
    assert gemma3.native_decode_lora is None
    gemma = Pair(tiny_checkpoints["gemma"], q8_0_blocks(tiny_checkpoints["gemma"].load_weights()))
    assert gemma.native.model.native_decode_lora is not None
    assert native_decode.max_rows(gemma.native.model.native_decode) > 0


def test_a_gemma3_layer_is_refused_with_one_sandwich_norm_or_a_wrong_table(
    tiny_gemma3: TinyCheckpoint,
) -> None:
    """The step takes a layer's two sandwich norms together, each [hidden], a RoPE table of the
    model's shape and a window of 0 keys or more: anything else is a clear error rather than a
    read past the weights."""
    model = Pair(tiny_gemma3, q8_0_blocks(tiny_gemma3.load_weights())).native.model
    layer, c = model.layers[0], model.config
    assert layer.attn_out_norm is not None and layer.mlp_out_norm is not None
    shape = DecodeShape(
        c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, 1e-6, 0.2
    )
    projections = [
        ProjectionParts(p.parts, p.bias)  # type: ignore[union-attr]
        for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    ]
    rope = torch.zeros(8, c.head_dim)

    def step_model(
        attn_out: torch.Tensor | None,
        mlp_out: torch.Tensor | None,
        window: int = 0,
        table: torch.Tensor | None = None,
    ) -> DecodeStepModel:
        parts = LayerParts(
            layer.input_norm,
            layer.post_norm,
            *projections,
            layer.q_norm,
            layer.k_norm,
            attn_out,
            mlp_out,
            window,
            table,
        )
        return DecodeStepModel(shape, [parts], model.norm, rope)

    assert not step_model(layer.attn_out_norm, layer.mlp_out_norm, 8, rope + 1).takes_lora
    assert step_model(None, None).takes_lora  # no sandwich norms
    for attn_out, mlp_out in [
        (layer.attn_out_norm, None),
        (None, layer.mlp_out_norm),
        (layer.attn_out_norm, torch.ones(c.hidden_size + 1)),
    ]:
        with pytest.raises(ValueError, match="sandwich norms"):
            step_model(attn_out, mlp_out)
    with pytest.raises(ValueError, match="RoPE table"):
        step_model(None, None, table=torch.zeros(4, c.head_dim))
    with pytest.raises(ValueError, match="sliding window"):
        step_model(None, None, window=-1)
