"""The fused native decode step and the prefill at Qwen2.5-0.5B's odd sizes, shrunk: its 14 query
heads of 64 over 2 kv heads (GQA 7:1, a group no power of two), hidden 448 and an MLP of 2432
(rows of 14, 28 and 76 blocks of 32 into q/k/v, o and down: no whole 256-value super-blocks, so
no K format fits, as at 0.5B's 896), q/k/v biases, tied embeddings. Against the torch path of
the same weights: over F32 rows (the dense oneDNN path beside it), over Q8_0 and Q4_0 blocks,
one row and three, and with bfloat16 activations; over Q5_0 and Q5_1 blocks (what Q4_K_M and
Q5_K_M files of that shape hold) fed the same tokens as the dense torch path of the dequantized
weights, close to it; a bfloat16 prefill over Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 blocks on the int8
product (its panels' last super-block padded)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import Segment
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers import linear
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.cpu import quant_i8gemm_native
from asyncengine.kernels.quant_formats import QuantizedTensor
from asyncengine.kernels.reference import quant_ref
from tests.conftest import TINY_CONFIGS, TinyCheckpoint, make_tiny_checkpoint
from tests.executor.fused_step_checks import check_bf16_step, check_f32_step, check_q8_0_step
from tests.executor.test_decode_step_bf16 import _teacher_forced
from tests.executor.test_native_decode import (
    PROMPTS,
    Pair,
    _compare,
    _count_fused_rows,
    _gguf_block,
    _plan,
)
from tests.kernels.test_quant_i8gemm import needs_fast
from tests.native_support import needs_native

pytestmark = needs_native

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


@pytest.mark.parametrize(
    "kind", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1], ids=lambda kind: kind.name
)
def test_a_q5_step_at_odd_widths_decodes_as_the_dequantized_weights(
    odd_qwen2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, kind: GGMLQuantizationType
) -> None:
    """Q5 blocks as gguf-py writes them, on the fused step (their group kernels at rows of 14, 28
    and 76 blocks), fed the same tokens as the dense torch path over the blocks' float32 values:
    every step's logits within the int8 activations' rounding of it (PREFILL_TOLERANCE), and the
    same greedy token in at least 9 of 10 rows (a tiny random model's near ties can flip)."""
    weights = {
        name: _gguf_block(w, kind) if w.dim() == 2 else w
        for name, w in odd_qwen2.load_weights().items()
    }
    dense = {
        name: quant_ref.dequantize(w) if isinstance(w, QuantizedTensor) else w
        for name, w in weights.items()
    }
    native = Pair(odd_qwen2, weights).native
    reference = Pair(odd_qwen2, dense, dense_reference=monkeypatch).torch_path
    rows = _count_fused_rows(native, monkeypatch)
    got_steps = _teacher_forced(native, PROMPTS, 8)
    want_steps = _teacher_forced(reference, PROMPTS, 8)
    assert rows == [len(PROMPTS)] * 8
    same = 0
    for step, (got, want) in enumerate(zip(got_steps, want_steps, strict=True)):
        error = float((got - want).abs().max() / want.abs().max())
        assert error < PREFILL_TOLERANCE, (step, error)
        same += int((got.argmax(-1) == want.argmax(-1)).sum())
    assert same >= 0.9 * 8 * len(PROMPTS), same


def test_a_bfloat16_step_at_odd_widths_decodes_through_the_step(
    odd_qwen2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_bf16_step(odd_qwen2, monkeypatch, PROMPTS, steps=8)


# a prefill's largest logit difference over its largest |logit|, bfloat16 activations rounded to
# int8 against the float32 torch path: measured 0.029-0.046 (the bfloat16 torch path's own
# 0.019-0.029)
PREFILL_TOLERANCE = 0.08


def _prefill_logits(ckpt: TinyCheckpoint, weights: dict[str, Any], dtype: torch.dtype) -> Any:
    """The last position's logits of every prompt of PROMPTS prefilled together (21 rows)."""
    config = ModelConfig.from_hf_dict(ckpt.hf_config)
    pages = 8
    pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, 4 * pages, 4, dtype)
    table = PageTable(len(PROMPTS), pages)
    for row in range(len(PROMPTS)):
        table.set_pages(row, 0, np.arange(row * pages, (row + 1) * pages))
    runner = ModelRunner(config, dict(weights), pool, table, dtype)
    runner.model.native_decode = None
    prefill = [Segment(f"r{i}", i, p, 0, True) for i, p in enumerate(PROMPTS)]
    with torch.inference_mode():
        return runner.forward_logits(_plan(0, prefill, [])).float()


@needs_fast
@pytest.mark.usefixtures("without_amx")
@pytest.mark.parametrize(
    "kind",
    [
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
    ],
    ids=lambda kind: kind.name,
)
def test_a_bfloat16_prefill_at_odd_widths_takes_the_int8_product(
    odd_qwen2: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, kind: GGMLQuantizationType
) -> None:
    """Its 21 rows (past every block format's I8_FROM_ROWS_BY_FORMAT) go through the int8
    product in every projection (rows of 448, 896 and 2432 values; the last layer's o, gate_up
    and down take the 3 sampled rows only), and the logits follow the float32 torch path of the
    dequantized weights."""
    weights = {
        name: _gguf_block(w, kind) if w.dim() == 2 else w
        for name, w in odd_qwen2.load_weights().items()
    }
    widths: Counter[int] = Counter()  # the int8 products of the whole prefill, by row length
    for entry in ("linear", "silu_linear"):
        original = getattr(quant_i8gemm_native, entry)

        def counting(
            x: torch.Tensor, panels: Any, *args: Any, _f: Any = original, **kw: Any
        ) -> Any:
            if x.shape[0] == sum(map(len, PROMPTS)):
                widths[panels.cols] += 1
            return _f(x, panels, *args, **kw)

        monkeypatch.setattr(quant_i8gemm_native, entry, counting)
    got = _prefill_logits(odd_qwen2, weights, torch.bfloat16)
    layers = odd_qwen2.hf_config["num_hidden_layers"]
    # qkv and gate_up, o, down
    assert widths == {448: 2 * layers - 1, 896: layers - 1, 2432: layers - 1}
    dense = {
        name: quant_ref.dequantize(w) if isinstance(w, QuantizedTensor) else w
        for name, w in weights.items()
    }
    monkeypatch.setenv(linear.FLOAT_ROWS_ENV, "0")  # dense ``Linear``s: the torch path
    want = _prefill_logits(odd_qwen2, dense, torch.float32)
    error = float((got - want).abs().max() / want.abs().max())
    assert error < PREFILL_TOLERANCE, error
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
