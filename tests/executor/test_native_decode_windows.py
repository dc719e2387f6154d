"""The fused native decode step (kernels/cpu/cpu_decode_step.c) on the llama layer with a
sliding window: Mistral's on every layer, Qwen2's (use_sliding_window) on the layers from
max_window_layers on. Against the torch path of the same weights (itself against transformers:
test_model_parity.py) on the tiny checkpoints with a window of 8, decoded past it: float32
activations over Q8_0 blocks (one row and three) and over F32 rows."""

from __future__ import annotations

import pytest

from asyncengine.kernels.cpu.decode_step_native import DecodeStepModel
from tests.conftest import TinyCheckpoint
from tests.executor.fused_step_checks import check_f32_step, check_q8_0_step
from tests.executor.test_native_decode import PROMPTS
from tests.native_support import needs_native

pytestmark = needs_native
WINDOW = 8  # conftest's windowed checkpoints: every prompt's context passes it within the steps
LAYER_WINDOWS = {"mistral_window": [WINDOW, WINDOW], "qwen2_window": [0, WINDOW]}


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
@pytest.mark.parametrize("name", sorted(LAYER_WINDOWS))
def test_a_windowed_step_on_q8_0_blocks_follows_the_torch_path(
    tiny_checkpoints: dict[str, TinyCheckpoint],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    prompts: list[list[int]],
) -> None:
    """Contexts up to 23 keys over a window of 8, each layer's window in the step as the torch
    path runs it."""
    pair = check_q8_0_step(tiny_checkpoints[name], monkeypatch, prompts, steps=12)
    model = pair.native.model
    assert [o.window for o in model.layer_options] == LAYER_WINDOWS[name]
    assert isinstance(model.native_decode, DecodeStepModel)
    assert [layer.window for layer in model.native_decode._layers] == LAYER_WINDOWS[name]


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_float32_mistral_step_on_f32_rows_follows_the_dense_torch_path(
    tiny_checkpoints: dict[str, TinyCheckpoint],
    monkeypatch: pytest.MonkeyPatch,
    prompts: list[list[int]],
) -> None:
    check_f32_step(tiny_checkpoints["mistral_window"], monkeypatch, prompts, steps=10)
