"""The fused native decode step on Gemma 2 (kernels/cpu/cpu_decode_step.c): the attention
soft-cap (each scaled score s becomes cap * tanh(s / cap) before the softmax) on top of what
Gemma 3 has (sandwich norms, a GELU gate, sliding layers, query_pre_attn_scalar), and the
final-logit soft-cap applied to the LM head's output after the step. Against the torch path of
the same weights on the tiny Gemma 2 (conftest's "gemma2": a cap of 2 that bends the scores,
a final cap of 5, a window of 8 on layers 0 and 2, head_dim 64, GQA 4 / 2), decoded past the
window: float32 activations over Q8_0 blocks (built for this CPU and for AVX2) and over F32 rows,
one row and three, and bfloat16 activations; a Q8_0 GGUF as llama.cpp's converter writes it
loads onto the step. Split-K over a capped layer's long rows: tests/kernels/test_fused_attention.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncengine.executor.layers.linear import QuantizedLinear
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
from tests.executor.test_native_decode import PROMPTS, Pair, _compare, _count_fused_rows
from tests.native_support import needs_native

pytestmark = needs_native
WINDOW = 8  # conftest's "gemma2": every prompt's context passes it within the steps below
SOFTCAP = 2.0
ROWS = [PROMPTS, PROMPTS[:1]]


@pytest.fixture(params=["native", "avx2"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The step's library as built for this CPU (16-key streamed blocks, the cap in 16 lanes),
    or forced to AVX2 (-mno-avx512f: the blocks of 32 keys, the cap in 8 lanes and a tail)."""
    with step_built_with(("-mno-avx512f",) if request.param == "avx2" else None):
        yield request.param


@pytest.fixture
def tiny_gemma2(tiny_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    ckpt = tiny_checkpoints["gemma2"]
    c = ModelConfig.from_hf_dict(ckpt.hf_config)
    assert c.attn_logit_softcap == SOFTCAP and c.final_logit_softcap == 5.0
    assert c.sandwich_norms and c.activation == "gelu_tanh" and c.sliding_window == WINDOW
    return ckpt


def _assert_gemma2_layers(pair: Pair) -> None:
    """The fused model holds every layer's cap and window as the torch path runs them."""
    model = pair.native.model
    options = [(o.window, o.softcap) for o in model.layer_options]
    assert options == [(WINDOW, SOFTCAP), (0, SOFTCAP)] * 2
    assert model.native_decode is not None
    assert [layer.softcap for layer in model.native_decode._layers] == [SOFTCAP] * 4
    assert [layer.window for layer in model.native_decode._layers] == [WINDOW, 0] * 2


@pytest.mark.parametrize("prompts", ROWS, ids=["3 rows", "1 row"])
def test_a_gemma2_step_on_q8_0_blocks_follows_the_torch_path(
    tiny_gemma2: TinyCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    prompts: list[list[int]],
    isa: str,
) -> None:
    """Contexts up to 23 keys over a window of 8; with the attention cap left out of the step
    its logits leave the torch path's by far more than the tolerance."""
    _assert_gemma2_layers(check_q8_0_step(tiny_gemma2, monkeypatch, prompts, steps=12))


@pytest.mark.parametrize("prompts", ROWS, ids=["3 rows", "1 row"])
def test_a_float32_gemma2_step_on_f32_rows_follows_the_dense_torch_path(
    tiny_gemma2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    check_f32_step(tiny_gemma2, monkeypatch, prompts, steps=10)


@pytest.mark.parametrize("prompts", ROWS, ids=["3 rows", "1 row"])
def test_a_bfloat16_gemma2_decodes_through_the_step(
    tiny_gemma2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """The worst step's noise wider than the other families': at 3 rows one step of one row
    strays 0.070 of the largest logit against the torch path's 0.052, while over 30 steps the
    fused step is the nearer on average (0.030 against 0.033); without the cap in the step it
    fails at either row count."""
    check_bf16_step(tiny_gemma2, monkeypatch, prompts, steps=10, worst_noise=1.4)


def test_the_fused_step_logits_are_final_capped(
    tiny_gemma2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step gives final-normed hidden states; the LM head's logits of a fused decode are
    soft-capped at the final cap (5) after it, as the torch path's."""
    pair = Pair(tiny_gemma2, q8_0_blocks(tiny_gemma2.load_weights()))
    model = pair.native.model
    rows = _count_fused_rows(pair.native, monkeypatch)
    hidden: list[torch.Tensor] = []
    original = model.native_decode.step  # type: ignore[union-attr]

    def keep(*args: object) -> torch.Tensor:
        out = original(*args)
        hidden.append(out)
        return out

    monkeypatch.setattr(model.native_decode, "step", keep)
    _compare(pair, steps=4)
    assert rows == [len(PROMPTS)] * 4
    head = model.lm_head
    raw = head.float32_out(hidden[-1]) if isinstance(head, QuantizedLinear) else head(hidden[-1])
    assert raw.abs().max() > 5.0  # the cap bends these logits
    capped = model.compute_logits(hidden[-1])
    assert capped.abs().max() < 5.0
    torch.testing.assert_close(capped, 5.0 * torch.tanh(raw / 5.0))


def test_a_gemma2_q8_0_gguf_loads_onto_the_fused_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q8_0 GGUF of Gemma 2 as llama.cpp's converter writes it (soft-caps and a window of 16
    in its metadata): read as the engine reads it, its decode steps are fused and follow the
    torch path past the window."""
    pair = check_gguf_step("gemma2_softcaps_sliding", tmp_path, monkeypatch)
    options = [(o.window, o.softcap) for o in pair.native.model.layer_options]
    assert options == [(16, 20.0), (0, 20.0)]


@pytest.mark.parametrize("cap", [-1.0, float("inf"), float("nan")])
def test_a_layer_with_a_bad_soft_cap_is_refused(tiny_gemma2: TinyCheckpoint, cap: float) -> None:
    """A cap is a finite float of 0 (none) or more: anything else is a clear error."""
    model = Pair(tiny_gemma2, q8_0_blocks(tiny_gemma2.load_weights())).native.model
    layer, c = model.layers[0], model.config
    shape = DecodeShape(
        c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, 1e-6, 0.2
    )
    projections = [
        ProjectionParts(p.parts, p.bias)  # type: ignore[union-attr]
        for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    ]
    parts = LayerParts(layer.input_norm, layer.post_norm, *projections, softcap=cap)
    with pytest.raises(ValueError, match="soft-cap"):
        DecodeStepModel(shape, [parts], model.norm, torch.zeros(8, c.head_dim))
