"""Quantized weights in the model: a GGUF's blocks kept as stored (q/k rows unpermuted as
bytes), the ``quantization`` config key, int8 of a float checkpoint, and on the embedded model
the logits, greedy agreement and perplexity against the same weights in float32
(scripts/quant_accuracy.py prints the same figures)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from transformers import LlamaConfig, LlamaForCausalLM

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.executor.layers import linear as linear_module
from asyncengine.executor.layers.linear import (
    DENSE_FROM_ROWS,
    DENSE_FROM_ROWS_BF16,
    DENSE_FROM_ROWS_BF16_BY_FORMAT,
    DENSE_FROM_ROWS_BY_FORMAT,
    QuantizedLinear,
    make_linear,
)
from asyncengine.executor.layers.model import LlamaModel
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import read_gguf
from asyncengine.executor.loader.quantized import load_model, quantize_int8
from asyncengine.kernels.quant_formats import F32, GGUF_FORMATS, I8, Q4_0, Q8_0, QuantizedTensor
from asyncengine.kernels.reference import quant_ref
from tests.conftest import TinyCheckpoint
from tests.executor.test_gguf import MERGES, TINY_TOKENS, _gguf_name, _llama_cpp_permute
from tests.native_support import needs_native
from tests.scripts.test_bench_scripts import load_script

# only a missing compiler skips: a kernel that fails to build with one fails these tests
pytestmark = needs_native


def test_a_bad_quantization_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'quantization'.*auto, none, int8"):
        EngineConfig(quantization="q4")


def test_int8_without_a_cpu_kernel_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no int8 kernel on cuda"):
        load_model("smollm2-135m", torch.bfloat16, torch.device("cuda"), "int8")


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GQA llama whose projections are Q8_0 (attention) and Q4_0 (gate/up), q/k rows
    permuted the llama.cpp way before quantizing; down_proj (48 columns) stays F32."""
    config = LlamaConfig(
        vocab_size=len(TINY_TOKENS),
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("quantized_gguf") / "tiny-q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(48)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(TINY_TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([3] * 3 + [1] * (len(TINY_TOKENS) - 3))
    writer.add_token_merges(MERGES)
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().copy()
        if ".q_proj." in name:
            array = _llama_cpp_permute(array, 4)
        elif ".k_proj." in name:
            array = _llama_cpp_permute(array, 2)
        kind = None
        if "self_attn" in name:
            kind = gguf.GGMLQuantizationType.Q8_0
        elif "gate_proj" in name or "up_proj" in name:
            kind = gguf.GGMLQuantizationType.Q4_0
        if kind is None:
            writer.add_tensor(_gguf_name(name), array)
        else:
            writer.add_tensor(_gguf_name(name), quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_int8_of_a_quantized_gguf_says_its_blocks_are_rounded_again(
    quantized_gguf: Path, tiny_llama: TinyCheckpoint, caplog: pytest.LogCaptureFixture
) -> None:
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="asyncengine.loader"):
        loaded = load_model(str(quantized_gguf), torch.float32, cpu, "int8")
    assert loaded.weights["model.layers.0.self_attn.q_proj.weight"].format == I8  # type: ignore[union-attr]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "quantization 'int8': the Q4_0, Q8_0 weights of tiny-q.gguf are expanded to float32 and "
        "rounded again to int8 rows, more bytes and more error than the blocks 'auto' keeps as "
        "stored"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncengine.loader"):
        load_model(str(tiny_llama.path), torch.float32, cpu, "int8")  # a float checkpoint
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_gguf_blocks_are_kept_and_their_rows_unpermuted(quantized_gguf: Path) -> None:
    dense = read_gguf(quantized_gguf, torch.float32).weights
    kept = read_gguf(quantized_gguf, torch.float32, frozenset(GGUF_FORMATS)).weights
    formats = {name: w.format for name, w in kept.items() if isinstance(w, QuantizedTensor)}
    assert formats["model.layers.0.self_attn.q_proj.weight"] == Q8_0
    assert formats["model.layers.1.mlp.up_proj.weight"] == Q4_0
    assert "model.layers.0.mlp.down_proj.weight" not in formats  # F32 in the file
    for name, weight in kept.items():
        expected = dense[name]
        assert isinstance(expected, torch.Tensor)
        got = quant_ref.dequantize(weight) if isinstance(weight, QuantizedTensor) else weight
        assert torch.equal(got, expected), name  # q/k: the same rows in the same order


def _model(weights: dict[str, Any], config: dict[str, Any]) -> LlamaModel:
    return LlamaModel(ModelConfig.from_hf_dict(config), weights, torch.float32)


def test_quantized_projections_follow_the_dense_ones(quantized_gguf: Path) -> None:
    from asyncengine.executor.loader.gguf_loader import hf_config, read_metadata

    reader = gguf.GGUFReader(quantized_gguf)
    config = hf_config(read_metadata(reader), {t.name for t in reader.tensors}, torch.float32)
    dense = _model(dict(read_gguf(quantized_gguf, torch.float32).weights), config)
    kept = _model(
        dict(read_gguf(quantized_gguf, torch.float32, frozenset(GGUF_FORMATS)).weights), config
    )
    assert isinstance(kept.layers[0].qkv, QuantizedLinear)
    down = kept.layers[0].down  # F32 in the file: float32 rows as they are
    assert isinstance(down, QuantizedLinear) and [p.format for p in down.parts] == [F32]
    x = torch.randn(3, 64)
    for name in ("qkv", "o_proj", "gate_up"):
        want = getattr(dense.layers[1], name)(x if name != "o_proj" else x)
        got = getattr(kept.layers[1], name)(x)
        # the only difference: x quantized to int8 blocks (relative error ~1%)
        assert float((got - want).norm() / want.norm()) < 0.02, name


def test_int8_checkpoint_logits_follow_float32(tiny_llama: TinyCheckpoint) -> None:
    weights = tiny_llama.load_weights()
    dense = _model(dict(weights), tiny_llama.hf_config)
    quantized = _model(quantize_int8(dict(weights)), tiny_llama.hf_config)
    assert isinstance(quantized.embed, QuantizedTensor) and quantized.embed.format == I8
    assert isinstance(quantized.layers[0].gate_up, QuantizedLinear)
    ids = torch.tensor([5, 17, 3, 90])
    assert torch.allclose(quantized.embed_tokens(ids), dense.embed_tokens(ids), atol=0.01)
    hidden = torch.randn(4, 64)
    want, got = dense.compute_logits(hidden), quantized.compute_logits(hidden)
    assert float((got - want).norm() / want.norm()) < 0.02


def test_large_batches_take_the_dense_product_of_the_same_weights() -> None:
    weight = quant_ref.quantize_i8(torch.randn(40, 64))
    linear = make_linear([weight], None, torch.float32)
    assert isinstance(linear, QuantizedLinear) and linear.dense_from_rows == DENSE_FROM_ROWS
    reference = quant_ref.dequantize(weight)
    big = torch.randn(DENSE_FROM_ROWS, 64)
    torch.testing.assert_close(linear(big), big @ reference.T, rtol=1e-5, atol=1e-5)
    assert linear._dense is not None  # built by the large call, kept for the next
    small = torch.randn(3, 64)
    assert float((linear(small) - small @ reference.T).norm() / (small @ reference.T).norm()) < 0.02
    # deterministic mode (row blocks): always the batch-invariant quantized kernel
    invariant = make_linear([weight], None, torch.float32, row_block=32)
    assert isinstance(invariant, QuantizedLinear) and invariant.dense_from_rows is None


@needs_native
def test_interleaved_formats_stay_quantized_up_to_their_own_crossover() -> None:
    """Q4_0/Q4_1/Q8_0 (interleaved groups) keep the stored weights up to ~1-2k rows, the
    row-by-row I8 only below 64; a fused projection switches at its earliest part's crossover."""
    blocks = quantize(np.random.randn(40, 64).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    q4 = QuantizedTensor(Q4_0, torch.from_numpy(np.ascontiguousarray(blocks)), 64)
    i8 = quant_ref.quantize_i8(torch.randn(8, 64))
    grouped = make_linear([q4], None, torch.float32)
    assert isinstance(grouped, QuantizedLinear)
    assert grouped.dense_from_rows == DENSE_FROM_ROWS_BY_FORMAT["Q4_0"] > DENSE_FROM_ROWS
    reference = quant_ref.dequantize(q4)
    rows = torch.randn(DENSE_FROM_ROWS, 64)  # past I8's crossover: still the quantized kernel
    got = grouped(rows)
    assert grouped._dense is None
    assert float((got - rows @ reference.T).norm() / (rows @ reference.T).norm()) < 0.02
    both = make_linear([q4, i8], None, torch.float32)
    assert isinstance(both, QuantizedLinear) and both.dense_from_rows == DENSE_FROM_ROWS


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bfloat16_activations_take_the_dense_product_sooner_where_it_is_fast(
    monkeypatch: pytest.MonkeyPatch, fast_bf16: bool, without_amx: None
) -> None:
    """Where this CPU runs dense bfloat16 products fast (AVX-512 BF16, AMX), bfloat16
    activations meet them from the bfloat16 table's rows (the same weights dequantized), and
    the rows below stay on the quantized kernel; where bfloat16 is slow, the float32 table.
    (On an AMX CPU the AMX product takes Q4_0 instead: tests/kernels/test_quant_amx.py; on an
    AVX-512 VNNI one the int8 product, here turned off: tests/kernels/test_quant_i8gemm.py.)"""
    fastest = torch.bfloat16 if fast_bf16 else torch.float32
    monkeypatch.setattr(linear_module, "fastest_cpu_dtype", lambda: fastest)
    monkeypatch.delitem(linear_module.I8_BELOW_ROWS_BY_FORMAT, "Q4_0")
    blocks = quantize(np.random.randn(40, 64).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    q4 = QuantizedTensor(Q4_0, torch.from_numpy(np.ascontiguousarray(blocks)), 64)
    i8 = quant_ref.quantize_i8(torch.randn(8, 64))
    grouped = make_linear([q4], None, torch.bfloat16)
    both = make_linear([q4, i8], None, torch.bfloat16)
    as_float32 = make_linear([q4], None, torch.float32)
    assert isinstance(grouped, QuantizedLinear) and isinstance(both, QuantizedLinear)
    assert isinstance(as_float32, QuantizedLinear)
    assert as_float32.dense_from_rows == DENSE_FROM_ROWS_BY_FORMAT["Q4_0"]
    if not fast_bf16:
        assert grouped.dense_from_rows == DENSE_FROM_ROWS_BY_FORMAT["Q4_0"]
        return
    crossover = DENSE_FROM_ROWS_BF16_BY_FORMAT["Q4_0"]
    assert grouped.dense_from_rows == crossover < DENSE_FROM_ROWS_BY_FORMAT["Q4_0"]
    assert both.dense_from_rows == DENSE_FROM_ROWS_BF16 < crossover  # I8: the generic value
    reference = quant_ref.dequantize(q4).to(torch.bfloat16)
    below = torch.randn(crossover - 1, 64).to(torch.bfloat16)
    grouped(below)
    assert grouped._dense is None  # still the quantized kernel
    rows = torch.randn(crossover, 64).to(torch.bfloat16)
    got = grouped(rows)
    assert grouped._dense is not None and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, rows @ reference.T, rtol=0.02, atol=0.05)


def test_wide_q8_0_projections_meet_the_bfloat16_product_at_their_own_crossover(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With bfloat16 activations and no int8 product for it (a CPU without AVX-512 VNNI), a Q8_0
    projection of a 1B model's width crosses to the dense product at its own row count (a
    narrower one at the table's); one row below it (the q8 kernel) and at it (the dense copy)
    both follow the dequantized weights within 2% relative plus 1% of the largest sum of
    |products|, and a row in both calls agrees to that too."""
    monkeypatch.setattr(linear_module, "fastest_cpu_dtype", lambda: torch.bfloat16)
    monkeypatch.delitem(linear_module.I8_BELOW_ROWS_BY_FORMAT, "Q8_0")
    monkeypatch.setattr(linear_module, "AMX_FORMATS", frozenset())  # nor AMX, as such a CPU
    wide_cols = linear_module.WIDE_INPUT
    narrow_cols = wide_cols // 2
    weights = {
        cols: np.random.default_rng(cols).standard_normal((24, cols)).astype(np.float32)
        for cols in (narrow_cols, wide_cols)
    }
    blocks = {
        cols: QuantizedTensor(
            Q8_0,
            torch.from_numpy(np.ascontiguousarray(quantize(w, gguf.GGMLQuantizationType.Q8_0))),
            cols,
        )
        for cols, w in weights.items()
    }
    narrow = make_linear([blocks[narrow_cols]], None, torch.bfloat16)
    wide = make_linear([blocks[wide_cols]], None, torch.bfloat16)
    assert isinstance(narrow, QuantizedLinear) and isinstance(wide, QuantizedLinear)
    assert narrow.dense_from_rows == DENSE_FROM_ROWS_BF16_BY_FORMAT["Q8_0"]
    crossover = linear_module.DENSE_FROM_ROWS_BF16_WIDE_INPUT["Q8_0"]
    assert wide.dense_from_rows == crossover < narrow.dense_from_rows
    reference = quant_ref.dequantize(blocks[wide_cols]).to(torch.bfloat16).double()
    x = torch.randn(crossover, wide_cols, generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16)
    below = wide(x[: crossover - 1])
    assert wide._dense is None  # still the quantized kernel
    at = wide(x)
    assert wide._dense is not None and at.dtype == torch.bfloat16
    scale = float((x.double().abs() @ reference.abs().T).max())
    for got in (below, at):
        n = got.shape[0]
        torch.testing.assert_close(
            got.double(), x[:n].double() @ reference.T, rtol=0.02, atol=0.01 * scale
        )
    torch.testing.assert_close(
        below.double(), at[: crossover - 1].double(), rtol=0.02, atol=0.01 * scale
    )


def _accuracy_module() -> Any:
    return load_script("quant_accuracy")


@pytest.mark.slow
def test_embedded_model_accuracy_against_float32() -> None:
    """Logits, greedy tokens and perplexity of the native paths vs the same weights in fp32."""
    results = {r.name: r for r in _accuracy_module().evaluate(["gguf", "q8_0", "int8"])}
    gguf_run, q8, int8 = results["gguf"], results["q8_0"], results["int8"]
    # the file's own weights: only the activations are quantized (int8 blocks of 32); measured
    # unperturbed and under 1e-6 changes of the norms, five runs on AVX-512 VNNI and three on AVX2:
    # max 1.13-1.70, mean 0.14-0.15, argmax 96.0-97.5%, perplexity +0.03 to +0.80%, greedy
    # 120-163/192 tokens
    assert gguf_run.max_abs_logit_diff < 2.5 and gguf_run.mean_abs_logit_diff < 0.25
    assert gguf_run.argmax_agreement >= 0.94
    assert abs(gguf_run.perplexity_ratio - 1) < 0.015
    assert gguf_run.greedy_tokens_agreeing >= 0.5 * gguf_run.greedy_tokens_total
    # Q8_0 weights (their activations int8 too): perplexity +0.68 to +1.15%; int8 per row: +0.46
    # to +1.27% (the same runs)
    assert abs(q8.perplexity_ratio - 1) < 0.02
    assert abs(int8.perplexity_ratio - 1) < 0.02
    assert np.isfinite([r.perplexity for r in results.values()]).all()
