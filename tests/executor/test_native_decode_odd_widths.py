"""The fused native decode step at Qwen2.5-0.5B's odd sizes, shrunk: its 14 query heads of 64 over
2 kv heads (GQA 7:1, a group no power of two), hidden 448 and an MLP of 2432 (rows of 14, 28
and 76 blocks of 32 into q/k/v, o and down: no whole 256-value super-blocks, so no K format
fits, as at 0.5B's 896), q/k/v biases, tied embeddings. Against the torch path of the same weights: over F32 rows (the
dense oneDNN path beside it), over Q8_0 blocks (what a Q4_K_M file of that shape holds after
Q5_0 is widened) and Q4_0 blocks, one row and three, and with bfloat16 activations."""

from __future__ import annotations

from typing import Any

import pytest
from gguf import GGMLQuantizationType

from asyncengine.kernels.cpu import cpu_native
from tests.conftest import TINY_CONFIGS, TinyCheckpoint, make_tiny_checkpoint
from tests.executor.fused_step_checks import check_bf16_step, check_f32_step, check_q8_0_step
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

NAME = "qwen2_gqa7_odd_widths"
SHAPE: dict[str, Any] = {
    "tie_word_embeddings": True,
    "hidden_size": 448,
    "intermediate_size": 2432,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,  # not hidden / heads: o_proj's rows of 896, as at 0.5B
    "rope_theta": 1000000.0,
    # the init scaled to the width, so that attention stays far from uniform at hidden 448
    "initializer_range": 0.25 * (64 / 448) ** 0.5,
}


@pytest.fixture(scope="module")
def odd_qwen2(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(TINY_CONFIGS, NAME, ("qwen2", SHAPE))
        ckpt = make_tiny_checkpoint(NAME, tmp_path_factory.mktemp(NAME))
    config = ckpt.hf_config
    assert config["hidden_size"] % 256 and config["intermediate_size"] % 256
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 7
    assert config["num_attention_heads"] * config["head_dim"] == 896
    return ckpt


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_an_f32_step_at_odd_widths_follows_the_dense_torch_path(
    odd_qwen2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    check_f32_step(odd_qwen2, monkeypatch, prompts, steps=8)


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_q8_0_step_at_odd_widths_follows_the_torch_path(
    odd_qwen2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    check_q8_0_step(odd_qwen2, monkeypatch, prompts, steps=8)


def test_a_q4_0_step_at_odd_widths_follows_the_torch_path(
    odd_qwen2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = {
        name: _gguf_block(w, GGMLQuantizationType.Q4_0) if w.dim() == 2 else w
        for name, w in odd_qwen2.load_weights().items()
    }
    pair = Pair(odd_qwen2, weights)
    rows = _count_fused_rows(pair.native, monkeypatch)
    _compare(pair, steps=8)
    assert rows == [len(PROMPTS)] * 8


def test_a_bfloat16_step_at_odd_widths_decodes_through_the_step(
    odd_qwen2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_bf16_step(odd_qwen2, monkeypatch, PROMPTS, steps=8)
