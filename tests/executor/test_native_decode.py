"""The fused native decode step (kernels/cpu/cpu_decode_step.c via executor/cpu/native_decode.py) against
the torch path of the same quantized model: same logits within the int8 activations'
rounding, same greedy tokens, K/V written to the same slots; a float32 model (its projections
as F32 rows) against the dense oneDNN path; and the models and batches it leaves to the torch
path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.cpu import native_decode
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers import linear
from asyncengine.executor.layers.linear import DENSE_FROM_ROWS, DENSE_FROM_ROWS_BY_FORMAT, Linear
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader.quantized import quantize_int8
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.quant_formats import F32, GGUF_FORMATS, QuantizedTensor
from tests.conftest import TINY_CONFIGS, TinyCheckpoint, make_tiny_checkpoint
from tests.native_support import needs_native

pytestmark = needs_native

PAGE_SIZE = 4
MAX_LEN = 64
PROMPTS = [[5, 17, 3, 90, 11, 40, 7], [9, 2, 33], [60, 61, 62, 63, 64, 65, 66, 67, 68, 70, 1]]
FLIP_TOLERANCE = 2e-2  # of the largest logit: a step where an activation's int8 rounding flipped


def _gguf_block(weight: torch.Tensor, kind: GGMLQuantizationType) -> QuantizedTensor:
    data = quantize(weight.float().numpy(), kind)
    return QuantizedTensor(
        GGUF_FORMATS[int(kind)], torch.from_numpy(np.ascontiguousarray(data)), weight.shape[1]
    )


def mixed_formats(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """q and gate in Q8_0, k/v and up in Q4_1 (so q/k/v and gate/up are two parts each), o in
    Q4_0, down (96 columns) in our I8, embedding and norms dense."""
    kinds = {
        "q_proj": GGMLQuantizationType.Q8_0,
        "k_proj": GGMLQuantizationType.Q4_1,
        "v_proj": GGMLQuantizationType.Q4_1,
        "o_proj": GGMLQuantizationType.Q4_0,
        "gate_proj": GGMLQuantizationType.Q8_0,
        "up_proj": GGMLQuantizationType.Q4_1,
    }
    out: dict[str, Any] = quantize_int8({k: v for k, v in weights.items() if "down_proj" in k})
    for name, weight in weights.items():
        if name in out:
            continue
        kind = next((k for part, k in kinds.items() if f".{part}." in name), None)
        out[name] = weight if kind is None else _gguf_block(weight, kind)
    return out


class Pair:
    """Two runners over the same weights, each with its own pool: one with the fused step, one
    with the torch path only (``dense_reference``: its float32 projections dense ``Linear``s,
    today's oneDNN path, rather than F32 rows)."""

    def __init__(
        self,
        ckpt: TinyCheckpoint,
        weights: dict[str, Any],
        dense_reference: pytest.MonkeyPatch | None = None,
        dtype: torch.dtype = torch.float32,
        max_len: int = MAX_LEN,
    ) -> None:
        """``max_len``: the longest row its page tables hold (the model's RoPE rows)."""
        self.config = ModelConfig.from_hf_dict(ckpt.hf_config)
        self.dtype = dtype  # the activations' and the pool's
        self.max_len = max_len
        self.native = self._runner(weights)
        if dense_reference is None:
            self.torch_path = self._runner(weights)
        else:
            with dense_reference.context() as patch:
                patch.setenv(linear.FLOAT_ROWS_ENV, "0")
                self.torch_path = self._runner(weights)
        self.runners = [self.native, self.torch_path]
        assert self.native.model.native_decode is not None
        self.torch_path.model.native_decode = None

    def _runner(self, weights: dict[str, Any]) -> ModelRunner:
        c = self.config
        pages = -(-self.max_len // PAGE_SIZE)
        pool = KVPool(
            c.num_layers, c.num_kv_heads, c.head_dim, pages * 4 + 1, PAGE_SIZE, self.dtype
        )
        pool.k.fill_(float("nan"))  # a read of a slot never written poisons the logits
        pool.v.fill_(float("nan"))
        table = PageTable(4, pages)
        order = np.random.default_rng(0).permutation(pages * 4 + 1)
        for row in range(4):
            table.set_pages(row, 0, order[row * pages : (row + 1) * pages])
        return ModelRunner(c, dict(weights), pool, table, self.dtype)


def _plan(step: int, extends: list[Segment], decodes: list[Segment]) -> BatchPlan:
    n = sum(s.sample for s in extends + decodes)
    sampling = [SamplingInfo(SamplingParams(temperature=0.0), [], []) for _ in range(n)]
    return BatchPlan(step=step, extends=extends, decodes=decodes, sampling=sampling)


def _run_both(
    pair: Pair, steps: int, prompts: list[list[int]] = PROMPTS
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill every prompt (torch path in both), then ``steps`` greedy decode steps of all
    requests together; the logits of each decode step, per runner."""
    logits: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for runner, out in zip(pair.runners, logits, strict=True):
        prefill = [Segment(f"r{i}", i, p, 0, True) for i, p in enumerate(prompts)]
        tokens = runner.forward_logits(_plan(0, prefill, [])).argmax(-1).tolist()
        lengths = [len(p) for p in prompts]
        for step in range(steps):
            decodes = [
                Segment(f"r{i}", i, [tokens[i]], lengths[i], True) for i in range(len(prompts))
            ]
            step_logits = runner.forward_logits(_plan(step + 1, [], decodes))
            out.append(step_logits)
            tokens = step_logits.argmax(-1).tolist()
            lengths = [n + 1 for n in lengths]
    return logits


def _count_fused_rows(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that records the rows of every fused step ``runner`` takes from now on."""
    model = runner.model.native_decode
    assert model is not None
    rows: list[int] = []
    original = model.step

    def counting(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return original(hidden, *args)

    monkeypatch.setattr(model, "step", counting)
    return rows


def _compare(
    pair: Pair,
    steps: int = 12,
    prompts: list[list[int]] = PROMPTS,
    tolerance: float = 2e-3,
    int8_activations: bool = True,
) -> None:
    native, reference = _run_both(pair, steps, prompts)
    flipped = 0
    for step, (got, want) in enumerate(zip(native, reference, strict=True)):
        assert torch.isfinite(got).all(), step  # every key read was written
        scale = float(want.abs().max())
        # the same kernels and quantized activations; the float sums in another order (the
        # attention's softmax: another kernel), which can move an activation's int8 rounding by
        # one step: a step of a tiny model then moves by up to ~1% of its largest logit (0.6-0.8%
        # seen on AVX-512, where the attention kernels' sums part more), the others stay close
        error = float((got - want).abs().max()) / scale
        assert error < (FLIP_TOLERANCE if int8_activations else tolerance), step
        flipped += error >= tolerance
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), step
    assert flipped <= steps // 4
    for layer in range(pair.config.num_layers):  # K/V of every token at the same slots
        k_native = pair.native.kv_pool.k_cache(layer)
        k_torch = pair.torch_path.kv_pool.k_cache(layer)
        written = ~torch.isnan(k_torch)
        assert torch.equal(written, ~torch.isnan(k_native))
        # past layer 0 a flipped int8 rounding of an attention output (above) moves the K of
        # the layers after it as it moves the logits: by up to ~1% of the largest
        atol = 1e-3
        if layer and int8_activations:
            atol = max(atol, FLIP_TOLERANCE * float(k_torch[written].abs().max()))
        torch.testing.assert_close(k_native[written], k_torch[written], atol=atol, rtol=1e-3)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "llama_tied"])
def test_fused_step_follows_the_torch_path_on_int8_weights(
    tiny_checkpoints: dict[str, TinyCheckpoint], name: str
) -> None:
    ckpt = tiny_checkpoints[name]
    _compare(Pair(ckpt, quantize_int8(ckpt.load_weights())))


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "llama_tied"])
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_fused_step_on_float32_weights_follows_the_dense_torch_path(
    tiny_checkpoints: dict[str, TinyCheckpoint],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    prompts: list[list[int]],
) -> None:
    """A dense float32 checkpoint: its projections (and a tied LM head, which then serves the
    embedding lookups too) become F32 rows and its decode steps take the fused step, whose
    logits are those of the oneDNN torch path within float32 summation order, with the same
    greedy tokens and K/V."""
    ckpt = tiny_checkpoints[name]
    pair = Pair(ckpt, ckpt.load_weights(), dense_reference=monkeypatch)
    model = pair.native.model
    assert all(
        part.format == F32
        for layer in model.layers
        for projection in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        for part in projection.parts  # type: ignore[union-attr]
    )
    assert isinstance(pair.torch_path.model.layers[0].qkv, Linear)
    if name == "llama_tied":  # one copy of the table: the head's F32 rows
        assert isinstance(model.embed, QuantizedTensor) and model.embed.format == F32
    rows = _count_fused_rows(pair.native, monkeypatch)
    _compare(pair, steps=8, prompts=prompts, tolerance=1e-4, int8_activations=False)
    assert rows == [len(prompts)] * 8


def test_one_request_takes_its_new_key_and_value_without_a_store_phase(
    tiny_llama: TinyCheckpoint,
) -> None:
    """Batch 1 (kernels/cpu/cpu_decode_step.c): each head takes the new K/V from the qkv row and the
    first head of each kv group stores it (the pool starts as NaN: a key read before it is
    written, or never stored, poisons the logits or the K/V comparison)."""
    _compare(Pair(tiny_llama, quantize_int8(tiny_llama.load_weights())), prompts=PROMPTS[:1])


def test_fused_step_follows_the_torch_path_on_mixed_gguf_formats(
    tiny_llama: TinyCheckpoint,
) -> None:
    pair = Pair(tiny_llama, mixed_formats(tiny_llama.load_weights()))
    layer = pair.native.model.layers[0]
    assert len(layer.qkv.parts) == 2 and len(layer.gate_up.parts) == 2  # type: ignore[union-attr]
    _compare(pair)


def test_fused_step_with_parts_that_split_interleaved_row_groups(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v of 96 + 12 + 12 rows in three formats: k and v are each one interleaved group of 8
    rows and 4 rows as stored, so v's group starts in the middle of a thread's row tile and
    its rows are taken one by one there (as are q/k/v's and gate/up's in the torch path)."""
    overrides = {"tie_word_embeddings": True, "head_dim": 12, "num_attention_heads": 8}
    overrides |= {"num_key_value_heads": 1, "rope_theta": 10000.0}
    monkeypatch.setitem(TINY_CONFIGS, "llama_split_groups", ("llama", overrides))
    ckpt = make_tiny_checkpoint("llama_split_groups", tmp_path / "ckpt")
    kinds = {
        "q_proj": GGMLQuantizationType.Q8_0,
        "k_proj": GGMLQuantizationType.Q4_1,
        "v_proj": GGMLQuantizationType.Q4_0,
        "o_proj": GGMLQuantizationType.Q4_1,
        "gate_proj": GGMLQuantizationType.Q4_0,
        "up_proj": GGMLQuantizationType.Q4_1,
        "down_proj": GGMLQuantizationType.Q8_0,
        "embed_tokens": GGMLQuantizationType.Q8_0,
    }
    weights: dict[str, Any] = {}
    for name, weight in ckpt.load_weights().items():
        kind = next((k for part, k in kinds.items() if f".{part}." in name), None)
        weights[name] = weight if kind is None else _gguf_block(weight, kind)
    pair = Pair(ckpt, weights)
    qkv = pair.native.model.layers[0].qkv
    assert [p.shape[0] for p in qkv.parts] == [96, 12, 12]  # type: ignore[union-attr]
    assert all(p.interleaved for p in qkv.parts)  # type: ignore[union-attr]
    _compare(pair)


def test_fused_step_is_taken_for_small_decode_batches_only(
    tiny_llama: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = Pair(tiny_llama, quantize_int8(tiny_llama.load_weights()))
    calls = _count_fused_rows(pair.native, monkeypatch)
    _run_both(pair, steps=2)
    assert calls == [3, 3]  # the decode steps; the prefill took the torch path
    monkeypatch.setattr(native_decode, "NATIVE_DECODE_MAX_ROWS", 2)
    _run_both(pair, steps=1)
    assert calls == [3, 3]  # 3 requests: past the limit, the torch path


def test_the_fused_step_stops_where_the_projections_turn_dense(
    tiny_llama: TinyCheckpoint,
) -> None:
    """int8 weights (row-by-row kernels) take the dense product from DENSE_FROM_ROWS rows, so
    their fused step stops below it; interleaved Q8_0/Q4_x groups go up to the step's cap."""
    int8 = Pair(tiny_llama, quantize_int8(tiny_llama.load_weights())).native.model.native_decode
    assert native_decode.max_rows(int8) == DENSE_FROM_ROWS - 1
    mixed = Pair(tiny_llama, mixed_formats(tiny_llama.load_weights())).native.model.native_decode
    assert native_decode.max_rows(mixed) == DENSE_FROM_ROWS - 1  # its down projection is I8
    grouped = {
        name: _gguf_block(w, GGMLQuantizationType.Q8_0) if w.dim() == 2 and "proj" in name else w
        for name, w in tiny_llama.load_weights().items()
    }
    q8 = Pair(tiny_llama, grouped).native.model.native_decode
    assert native_decode.max_rows(q8) == native_decode.NATIVE_DECODE_MAX_ROWS
    f32 = Pair(tiny_llama, tiny_llama.load_weights()).native.model.native_decode
    assert native_decode.max_rows(f32) == DENSE_FROM_ROWS_BY_FORMAT["F32"] - 1
    assert native_decode.max_rows(None) == 0


def test_models_the_fused_step_does_not_cover_keep_the_torch_path(
    tiny_checkpoints: dict[str, TinyCheckpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fused(name: str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> bool:
        ckpt = tiny_checkpoints[name]
        config = ModelConfig.from_hf_dict(ckpt.hf_config)
        pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, 8, PAGE_SIZE, dtype)
        weights = quantize_int8(ckpt.load_weights())
        runner = ModelRunner(config, weights, pool, PageTable(2, 4), dtype, **kwargs)
        return runner.model.native_decode is not None

    assert fused("llama_gqa")
    assert not fused("llama_gqa", deterministic=True)  # row blocks: the torch path
    assert fused("llama_gqa", torch.bfloat16)  # float32 inside: test_decode_step_bf16.py
    assert fused("qwen3_qk_norm")  # per-head q/k norms: test_native_decode_qwen3.py
    assert fused("gemma3")  # sandwich norms, windows, GeGLU: test_native_decode_gemma3.py
    assert fused("gemma")  # GeGLU
    assert fused("gemma2")  # attention soft-caps: test_native_decode_gemma2.py
    dense = tiny_checkpoints["llama_gqa"]
    config = ModelConfig.from_hf_dict(dense.hf_config)

    def dense_fused(dtype: torch.dtype) -> bool:
        pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, 8, PAGE_SIZE, dtype)
        runner = ModelRunner(config, dense.load_weights(), pool, PageTable(2, 4), dtype)
        return runner.model.native_decode is not None

    assert dense_fused(torch.float32)  # float32 weights: F32 rows
    assert dense_fused(torch.bfloat16)  # bfloat16 weights: BF16 rows
    monkeypatch.setenv(linear.FLOAT_ROWS_ENV, "0")
    assert not dense_fused(torch.float32)  # F32 / BF16 rows turned off: dense Linears
    assert not dense_fused(torch.bfloat16)


def test_a_verify_step_runs_its_positions_as_fused_decode_rows(
    tiny_llama: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative verification of a row with 3 guesses takes the fused step as 4 decode rows
    (each attending over the K/V the rows before it stored in the same step) and keeps exactly
    the tokens that one-token fused decode steps make, with the same K/V in the same slots."""
    pair = Pair(tiny_llama, quantize_int8(tiny_llama.load_weights()))
    stepwise, verifier = pair.native, pair.torch_path
    verifier.model.native_decode = stepwise.model.native_decode  # both fused now
    verifier.verify_decode_rows = native_decode.VERIFY_DECODE_MAX_ROWS
    prompt = PROMPTS[0]
    tokens: list[int] = []
    for runner in (stepwise, verifier):
        first = runner.forward_logits(_plan(0, [Segment("r", 0, prompt, 0, True)], []))
        tokens = [int(first.argmax(-1))]
    for step in range(4):  # the greedy continuation, one fused decode step at a time
        segment = Segment("r", 0, [tokens[-1]], len(prompt) + step, True)
        tokens.append(int(stepwise.forward_logits(_plan(step + 1, [], [segment])).argmax(-1)))
    rows = _count_fused_rows(verifier, monkeypatch)
    guessed = Segment("r", 0, tokens[:4], len(prompt), True, guesses=3)
    out = verifier.execute(_plan(1, [], [guessed]))
    assert rows == [4]
    assert out.accepted == [3] and out.token_ids == [tokens[4]]
    for layer in range(pair.config.num_layers):
        k_step, k_verify = stepwise.kv_pool.k_cache(layer), verifier.kv_pool.k_cache(layer)
        written = ~torch.isnan(k_step)
        assert torch.equal(written, ~torch.isnan(k_verify))
        torch.testing.assert_close(k_verify[written], k_step[written], atol=1e-5, rtol=1e-5)


def test_a_one_row_fused_step_is_bit_identical_on_one_thread_and_on_two(
    tiny_llama: TinyCheckpoint,
) -> None:
    """One stream's decode steps choose their thread count (executor/cpu/step_threads.py): the
    count must never change a logit (rows of each product and attention heads split across
    threads, never a sum). The same step twice writes the same K/V at the same slot."""
    pair = Pair(tiny_llama, quantize_int8(tiny_llama.load_weights()))
    runner = pair.native
    prompt = PROMPTS[0]
    token = runner.forward_logits(_plan(0, [Segment("r", 0, prompt, 0, True)], [])).argmax(-1)
    step = _plan(1, [], [Segment("r", 0, [int(token)], len(prompt), True)])
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            results.append(runner.forward_logits(step))
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(results[0]).all()
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
