"""The fused decode step of a bfloat16 model (kernels/cpu/cpu_decode_step.c's -DKV_BF16 build): its
attention over a bfloat16 pool against the torch reference over the same values widened, the
whole step over a bfloat16 pool against its float32 build over the same values (the new K/V
rounded to nearest even as torch rounds them), and a bfloat16 runner that takes the step for its
decodes, no further from the float32 model than its bfloat16 torch path, and a dense bfloat16
checkpoint whose projections are BF16 rows doing the same."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncengine.common.plan import Segment
from asyncengine.executor.cpu import native_decode
from asyncengine.executor.layers.linear import Linear, QuantizedLinear
from asyncengine.executor.loader.quantized import quantize_int8
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.cpu import cpu_native, decode_step_native
from asyncengine.kernels.quant_formats import BF16 as BF16_ROWS
from asyncengine.kernels.quant_formats import QuantizedTensor
from asyncengine.kernels.reference.attention_ref import decode_attention
from tests.conftest import TinyCheckpoint
from tests.executor.test_native_decode import PROMPTS, Pair, _count_fused_rows, _plan
from tests.kernels.test_kernels_ref import TOLERANCE, PagedKV
from tests.native_support import needs_native

pytestmark = needs_native
BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_the_bfloat16_build_loads_and_says_so() -> None:
    assert decode_step_native.available(BF16)
    lib = cpu_native.load("cpu_decode_step", decode_step_native.KV_BUILD_FLAGS[BF16])
    assert lib is not None and lib.asyncengine_kv_element() == 2 + 32


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [(9, 3, 64, 16), (16, 1, 64, 7), (12, 1, 120, 5), (6, 2, 20, 3), (40, 8, 32, 16)],
)
@pytest.mark.parametrize("seq_lens", [[1, 31, 32, 33, 70, 5, 129, 64], [97]], ids=["8", "1"])
def test_fused_step_attention_reads_a_bfloat16_pool(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    threads: int,
) -> None:
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, BF16, seed=head_dim)
    q = torch.randn(
        len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(page_size)
    )
    scale = head_dim**-0.5
    rest = (kv.block_table, kv.seq_lens, page_size, scale)
    got = decode_step_native.group_attention(q, kv.k_cache, kv.v_cache, *rest)
    # the reference over the same values in float32: both sides compute in float32
    ref = decode_attention(q, kv.k_cache.float(), kv.v_cache.float(), *rest)
    assert torch.isfinite(got).all(), "read a slot no request owns"
    torch.testing.assert_close(got, ref, atol=TOLERANCE[F32], rtol=0)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_step_over_a_bfloat16_pool_is_its_float32_step(
    tiny_llama: TinyCheckpoint, rows: int
) -> None:
    """The same bfloat16 hidden states and pool values, once in a float32 pool (float32 build)
    and once in a bfloat16 pool (bfloat16 build): layer 0's new K/V are the float32 build's
    rounded to nearest even, bit for bit; the outputs agree within bfloat16 rounding."""
    pair = Pair(tiny_llama, quantize_int8(tiny_llama.load_weights()))
    model = pair.native.model.native_decode
    assert model is not None
    c = pair.config
    page_size, pages = 4, 16
    gen = torch.Generator().manual_seed(rows)
    slots_total = rows * pages * page_size
    shape = (slots_total, c.num_kv_heads, c.head_dim)
    k16 = [torch.randn(shape, generator=gen).to(BF16) for _ in range(c.num_layers)]
    v16 = [torch.randn(shape, generator=gen).to(BF16) for _ in range(c.num_layers)]
    k32 = [t.float() for t in k16]
    v32 = [t.float() for t in v16]
    hidden = torch.randn(rows, c.hidden_size, generator=gen).to(BF16)
    table = torch.randperm(rows * pages, generator=gen).to(torch.int32).view(rows, pages)
    positions = torch.tensor([20 + 7 * i for i in range(rows)])
    slots = table[torch.arange(rows), positions // page_size].long() * page_size
    slots += positions % page_size
    lens = (positions + 1).to(torch.int32)

    model.bind_caches(k32, v32)
    want = model.step(hidden.float(), positions, slots, table, lens, page_size)
    model.bind_caches(k16, v16)
    got = model.step(hidden, positions, slots, table, lens, page_size)

    assert got.dtype == BF16 and want.dtype == F32
    scale = float(want.abs().max())
    torch.testing.assert_close(got.float(), want, atol=3e-2 * scale, rtol=0)
    assert torch.equal(k16[0][slots], k32[0][slots].to(BF16))
    assert torch.equal(v16[0][slots], v32[0][slots].to(BF16))
    others = torch.ones(slots_total, dtype=torch.bool)
    others[slots] = False
    for layer in range(c.num_layers):  # nothing else written; later layers' K/V close
        assert torch.equal(k16[layer][others].float(), k32[layer][others])
        torch.testing.assert_close(
            k16[layer][slots].float(), k32[layer][slots], atol=5e-2, rtol=2e-2
        )


def _teacher_forced(
    runner: ModelRunner, prompts: list[list[int]], steps: int
) -> list[torch.Tensor]:
    """The float32 logits of ``steps`` decode steps of every prompt, fed the same tokens whatever
    the runner samples (so that two runners' steps see the same inputs)."""
    prefill = [Segment(f"r{i}", i, p, 0, True) for i, p in enumerate(prompts)]
    runner.forward_logits(_plan(0, prefill, []))
    lengths = [len(p) for p in prompts]
    logits = []
    for step in range(steps):
        tokens = [(7 * step + 3 * i) % 50 + 1 for i in range(len(prompts))]
        decodes = [Segment(f"r{i}", i, [tokens[i]], lengths[i], True) for i in range(len(prompts))]
        logits.append(runner.forward_logits(_plan(step + 1, [], decodes)).float())
        lengths = [n + 1 for n in lengths]
    return logits


def _worst_error(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(
        float((got - want).abs().max()) / float(want.abs().max())
        for got, want in zip(logits, reference, strict=True)
    )


def _mean_error(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    errors = [
        float((got - want).abs().max()) / float(want.abs().max())
        for got, want in zip(logits, reference, strict=True)
    ]
    return sum(errors) / len(errors)


def _assert_no_further_than(
    fused: list[torch.Tensor],
    torch_path: list[torch.Tensor],
    reference: list[torch.Tensor],
    worst_noise: float = 1.25,
) -> None:
    """The fused step's logits are no further from the float32 oracle than the torch path's, on
    average, and its worst step within the noise of the torch path's worst (``worst_noise``
    times it): both round the K/V to bfloat16 and share the bfloat16 prefill, so which of two
    bfloat16 paths is nearer at one step of a tiny random model is a coin toss (0.096 against
    0.081 seen at 3 rows)."""
    assert _mean_error(fused, reference) <= 1.1 * _mean_error(torch_path, reference)
    assert _worst_error(fused, reference) <= worst_noise * _worst_error(torch_path, reference)


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["3 rows", "1 row"])
def test_a_bfloat16_runner_decodes_through_the_step(
    tiny_llama: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]]
) -> None:
    """A bfloat16 model with quantized weights over a bfloat16 pool takes the fused step for its
    decodes (float32 inside), writes the K/V of every token at the torch path's slots, and is
    no further from the float32 model's logits than its bfloat16 torch path is (a tiny random
    model's greedy tokens are near ties in bfloat16: the float32 run is the oracle)."""
    weights = quantize_int8(tiny_llama.load_weights())
    pair = Pair(tiny_llama, weights, dtype=BF16)
    assert pair.native.kv_pool.k_cache(0).dtype == BF16
    rows = _count_fused_rows(pair.native, monkeypatch)
    fused = _teacher_forced(pair.native, prompts, 8)
    assert rows == [len(prompts)] * 8
    torch_path = _teacher_forced(pair.torch_path, prompts, 8)
    reference = _teacher_forced(Pair(tiny_llama, weights).torch_path, prompts, 8)
    assert all(torch.isfinite(step).all() for step in fused)
    _assert_no_further_than(fused, torch_path, reference)
    for layer in range(pair.config.num_layers):  # K/V of every token at the same slots
        k_native = pair.native.kv_pool.k_cache(layer)
        k_torch = pair.torch_path.kv_pool.k_cache(layer)
        assert torch.equal(~torch.isnan(k_native), ~torch.isnan(k_torch))


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "llama_tied"])
@pytest.mark.parametrize("prompts", [PROMPTS[:2], PROMPTS[:1]], ids=["2 rows", "1 row"])
def test_a_bfloat16_checkpoint_decodes_through_the_step_on_its_bf16_rows(
    tiny_checkpoints: dict[str, TinyCheckpoint],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    prompts: list[list[int]],
) -> None:
    """A dense bfloat16 model: its projections (and a tied LM head, which then serves the
    embedding lookups) become BF16 rows over the same bytes, its decodes take the fused step
    (float32 inside, the weights widened as read), and its logits are no further from the same
    weights run in float32 than the dense oneDNN bfloat16 torch path's (the engine before BF16
    rows) are, on average over the steps; K/V of every token at the same slots. (Greedy tokens
    are not compared: a tiny random model's are near ties in bfloat16.)"""
    ckpt = tiny_checkpoints[name]
    weights = {k: v.to(BF16) for k, v in ckpt.load_weights().items()}
    pair = Pair(ckpt, weights, dense_reference=monkeypatch, dtype=BF16)
    model = pair.native.model
    projections = [
        projection
        for layer in model.layers
        for projection in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    ]
    assert all(
        isinstance(p, QuantizedLinear) and [part.format for part in p.parts] == [BF16_ROWS]
        for p in projections
    )
    assert isinstance(pair.torch_path.model.layers[0].qkv, Linear)
    if name == "llama_tied":  # one copy of the table: the head's BF16 rows
        assert isinstance(model.embed, QuantizedTensor) and model.embed.format == BF16_ROWS
    crossover = min(p.group_kernels_below(BF16) for p in projections)  # type: ignore[union-attr]
    most = min(crossover - 1, native_decode.bf16_max_rows())
    assert native_decode.max_rows(model.native_decode) == most >= len(prompts)
    rows = _count_fused_rows(pair.native, monkeypatch)
    fused = _teacher_forced(pair.native, prompts, 8)
    assert rows == [len(prompts)] * 8
    torch_path = _teacher_forced(pair.torch_path, prompts, 8)
    as_float32 = {k: v.float() for k, v in weights.items()}
    reference = _teacher_forced(Pair(ckpt, as_float32).torch_path, prompts, 8)
    assert all(torch.isfinite(step).all() for step in fused)
    # the fused step's float32 inside is closer on average (~0.5-0.6x the torch path's error)
    _assert_no_further_than(fused, torch_path, reference)
    for layer in range(pair.config.num_layers):
        k_native = pair.native.kv_pool.k_cache(layer)
        k_torch = pair.torch_path.kv_pool.k_cache(layer)
        assert torch.equal(~torch.isnan(k_native), ~torch.isnan(k_torch))
