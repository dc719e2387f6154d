"""The fused native decode step on the K formats, as a Q4_K_M file mixes them (Q4_K projections,
Q6_K v and down, a Q6_K tied embedding / LM head) and as Q5_K_M does: against the torch path of
the same weights (whose products take the same interleaved groups one projection at a time),
at a width of real K blocks (hidden 256, MLP 512: rows of whole 256-value super-blocks), on a
llama and on a Qwen3 (per-head q/k norms; 8 heads of 64 over 2 kv heads, hidden / heads 32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncengine.kernels.quant_formats import Q4_K, Q5_K, Q6_K, QuantFormat
from asyncengine.kernels.reference.kquant_ref import quantize_k
from tests.conftest import TINY_CONFIGS, make_tiny_checkpoint
from tests.executor.test_native_decode import (
    FLIP_TOLERANCE,
    PROMPTS,
    Pair,
    _count_fused_rows,
    _run_both,
)
from tests.native_support import needs_native

pytestmark = needs_native

MIXES: dict[str, dict[str, QuantFormat]] = {
    "Q4_K_M": {
        "q_proj": Q4_K, "k_proj": Q4_K, "v_proj": Q6_K, "o_proj": Q4_K,
        "gate_proj": Q4_K, "up_proj": Q4_K, "down_proj": Q6_K, "embed_tokens": Q6_K,
    },
    "Q5_K_M": {
        "q_proj": Q5_K, "k_proj": Q5_K, "v_proj": Q6_K, "o_proj": Q5_K,
        "gate_proj": Q5_K, "up_proj": Q5_K, "down_proj": Q6_K, "embed_tokens": Q6_K,
    },
}  # fmt: skip
STEPS = 12
WIDTHS = {"tie_word_embeddings": True, "hidden_size": 256, "intermediate_size": 512}
# name -> (architecture, shape)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_k_formats": (
        "llama",
        WIDTHS | {"num_attention_heads": 4, "num_key_value_heads": 1, "rope_theta": 10000.0},
    ),
    "qwen3_k_formats": (
        "qwen3",
        WIDTHS
        | {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
        | {"rope_theta": 1000000.0},
    ),
}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_fused_step_follows_the_torch_path_on_k_formats(
    mix: str, model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(TINY_CONFIGS, model, MODELS[model])
    ckpt = make_tiny_checkpoint(model, tmp_path / "ckpt")
    formats = MIXES[mix]
    weights: dict[str, Any] = {}
    for name, weight in ckpt.load_weights().items():
        fmt = next((f for part, f in formats.items() if f".{part}." in name), None)
        if fmt is None and "embed_tokens" in name:
            fmt = formats["embed_tokens"]
        weights[name] = weight if fmt is None else quantize_k(weight, fmt)
    pair = Pair(ckpt, weights)
    rows = _count_fused_rows(pair.native, monkeypatch)
    qkv = pair.native.model.layers[0].qkv
    assert [p.format for p in qkv.parts] == [formats["q_proj"], Q6_K]  # type: ignore[union-attr]
    assert all(p.interleaved for p in qkv.parts)  # type: ignore[union-attr]
    native, reference = _run_both(pair, STEPS, PROMPTS)
    errors = []
    for step, (got, want) in enumerate(zip(native, reference, strict=True)):
        assert torch.isfinite(got).all(), step
        errors.append(float((got - want).abs().max()) / float(want.abs().max()))
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), step
    assert rows == [len(PROMPTS)] * STEPS  # every decode step fused
    # the same kernels on both sides; the attention's float sums in another order can move an
    # activation's int8 rounding by one step, which at hidden 256 moves a step's logits by up
    # to ~1.5% of the largest (the row-by-row kernels' run of this model: 5 of 12 steps)
    assert max(errors) < FLIP_TOLERANCE, errors
    assert sorted(errors)[STEPS // 2] < 2e-3, errors
    # K/V of every token at the same slots (the keys of tokens after a flipped step move with it)
    for layer in range(pair.config.num_layers):
        k_native = pair.native.kv_pool.k_cache(layer)
        k_torch = pair.torch_path.kv_pool.k_cache(layer)
        written = ~torch.isnan(k_torch)
        assert torch.equal(written, ~torch.isnan(k_native))
        torch.testing.assert_close(k_native[written], k_torch[written], atol=1e-2, rtol=1e-2)
