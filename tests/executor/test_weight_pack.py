"""Parts packed in one pass (executor/cpu/weight_pack.py, kernels/cpu/cpu_weight_pack.c): the
bytes of the torch path they replace (rows gathered, merged by format, interleaved, moved into the
arena) for every format, row counts that leave tails, sources that are strided views and
gathered rows, any thread count; and the products the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncengine.executor.cpu import weight_arena
from asyncengine.executor.cpu.weight_pack import pack_parts, write_pending
from asyncengine.executor.layers import linear as linear_module
from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.kernels.cpu import quant_native, weight_pack_native
from asyncengine.kernels.cpu.weight_pack_native import RowSource
from asyncengine.kernels.quant_formats import FORMATS, QuantizedTensor, cat_rows
from asyncengine.kernels.reference.kquant_ref import quantize_k
from tests.conftest import TINY_CONFIGS, make_tiny_checkpoint
from tests.executor.test_native_decode import PROMPTS, Pair, _run_both
from tests.executor.test_native_decode_kquant import MIXES
from tests.kernels.test_quantized_kernels import random_weight
from tests.native_support import needs_native

pytestmark = needs_native

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
COLS = {"Q8_0": 96, "Q4_0": 64, "Q4_1": 96, "Q5_0": 64, "Q5_1": 96, "Q4_K": 512, "Q5_K": 256}
COLS.update({"Q6_K": 512, "I8": 64, "F32": 40, "BF16": 48})


def torch_path(parts: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """What the load did before: torch.cat per run of one format, then the interleave copy."""
    runs: list[list[QuantizedTensor]] = []
    for part in parts:
        if runs and runs[-1][0].format == part.format:
            runs[-1].append(part)
        else:
            runs.append([part])
    merged = [cat_rows(run) if len(run) > 1 else run[0].contiguous() for run in runs]
    return [quant_native.interleave(p) for p in merged if isinstance(p, QuantizedTensor)]


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_packed_bytes_are_the_torch_paths(name: str, threads: int) -> None:
    fmt, cols = FORMATS[name], COLS[name]
    # 8-row groups and a tail, one part under a group, and one of several chunks of groups
    parts = [random_weight(fmt, rows, cols, seed=rows) for rows in (21, 5, 300)]
    want = torch_path(parts)
    got = pack_parts(parts, None, interleave=True)
    assert got is not None and len(got) == len(want) == 1
    assert got[0].interleaved == want[0].interleaved
    assert torch.equal(got[0].data, want[0].data)
    out = torch.empty_like(want[0].data)
    weight_pack_native.pack_rows(fmt, [RowSource(p.data) for p in parts], cols, out, True, threads)
    assert torch.equal(out, want[0].data)


def test_mixed_formats_split_into_runs_and_land_in_the_arena_in_order_in_one_call() -> None:
    q4k, q6k = FORMATS["Q4_K"], FORMATS["Q6_K"]
    parts = [
        random_weight(q4k, 64, 512, seed=1),  # q
        random_weight(q4k, 16, 512, seed=2),  # k
        random_weight(q6k, 16, 512, seed=3),  # v: a Q4_K_M file's mix
    ]
    arena = weight_arena.arena_for(parts)
    assert arena is not None
    got = pack_parts(parts, arena, interleave=True)
    want = torch_path(parts)
    assert got is not None and [p.format for p in got] == [q4k, q6k]
    assert len(arena.pending) == 2  # handed their slices, written together
    write_pending(arena)
    assert arena.pending == []
    previous = arena.buffer.data_ptr()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.data, w.data)
        assert g.data.data_ptr() >= previous and g.data.data_ptr() % weight_arena.ALIGN == 0
        previous = g.data.data_ptr() + g.nbytes
    assert previous <= arena.buffer.data_ptr() + arena.buffer.numel()


def test_gathered_and_strided_rows() -> None:
    fmt = FORMATS["Q4_K"]
    weight = random_weight(fmt, 64, 512, seed=7)
    # the q/k unpermutation of llama.cpp's converter: 4 heads of 16 rows
    order = torch.arange(64).reshape(4, 8, 2).transpose(1, 2).reshape(64)
    wide = torch.zeros(64, weight.data.shape[1] + 40, dtype=torch.uint8)
    wide[:, 8 : 8 + weight.data.shape[1]] = weight.data
    strided = wide[:, 8 : 8 + weight.data.shape[1]]  # rows apart by more than a row's bytes
    want = quant_native.interleave(weight.select_rows(order)).data
    for source in (RowSource(weight.data, order), RowSource(strided, order)):
        out = torch.empty_like(want)
        weight_pack_native.pack_rows(fmt, [source], 512, out, True, 2)
        assert torch.equal(out, want)
    out = torch.empty_like(want)
    weight_pack_native.pack_rows(fmt, [RowSource(strided)], 512, out, True, 2)
    assert torch.equal(out, quant_native.interleave(weight).data)


def test_bad_sources_are_refused() -> None:
    fmt = FORMATS["Q8_0"]
    weight = random_weight(fmt, 16, 64, seed=1)
    out = torch.empty_like(weight.data)
    with pytest.raises(IndexError):
        bad = RowSource(weight.data, torch.tensor([0, 16]))
        weight_pack_native.pack_rows(fmt, [bad], 64, torch.empty(2, 68, dtype=torch.uint8), True, 1)
    with pytest.raises(ValueError, match="out must be"):
        weight_pack_native.pack_rows(fmt, [RowSource(weight.data)], 64, out[:8], True, 1)
    with pytest.raises(ValueError, match="rows of 32 values"):
        weight_pack_native.pack_rows(fmt, [RowSource(weight.data)], 32, out, True, 1)


def test_interleave_switched_off_keeps_rows_as_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(linear_module.INTERLEAVE_ENV, "0")
    parts = [random_weight(FORMATS["Q4_K"], 24, 256, seed=s) for s in (1, 2)]
    linear = QuantizedLinear(parts)
    assert len(linear.parts) == 1 and not linear.parts[0].interleaved
    assert torch.equal(linear.parts[0].data, torch.cat([p.data for p in parts]))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "F32"])
def test_products_match_the_torch_paths_linear(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fmt, cols = FORMATS[name], COLS[name]
    parts = [random_weight(fmt, rows, cols, seed=rows) for rows in (40, 24)]
    x = torch.randn(3, cols)
    packed = QuantizedLinear(parts)
    monkeypatch.setattr(linear_module, "pack_parts", lambda *args: None)  # the torch path
    through_torch = QuantizedLinear(parts)
    assert [p.data.shape for p in packed.parts] == [p.data.shape for p in through_torch.parts]
    for a, b in zip(packed.parts, through_torch.parts, strict=True):
        assert torch.equal(a.data, b.data)
    assert torch.equal(packed(x), through_torch(x))


def test_a_q4_k_m_model_packed_in_one_pass_has_the_torch_paths_weights_and_logits(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model of a Q4_K_M file's mix (Q4_K q/k, Q6_K v: two runs in one qkv; a Q6_K tied
    embedding), built twice: its weights packed in one pass, and through the torch copies. Every
    projection's bytes equal, in the arena in both; the logits of a prefill and decode steps
    (the fused native step) equal to the last bit."""
    overrides = {"tie_word_embeddings": True, "hidden_size": 256, "intermediate_size": 512}
    overrides |= {"num_attention_heads": 4, "num_key_value_heads": 1, "rope_theta": 10000.0}
    monkeypatch.setitem(TINY_CONFIGS, "llama_k_formats", ("llama", overrides))
    ckpt = make_tiny_checkpoint("llama_k_formats", tmp_path / "ckpt")
    formats = MIXES["Q4_K_M"]
    weights: dict[str, Any] = {}
    for name, weight in ckpt.load_weights().items():
        fmt = next((f for part, f in formats.items() if f".{part}." in name), None)
        if fmt is None and "embed_tokens" in name:
            fmt = formats["embed_tokens"]
        weights[name] = weight if fmt is None else quantize_k(weight, fmt)
    one_pass = Pair(ckpt, weights)
    with monkeypatch.context() as patch:
        patch.setattr(linear_module, "pack_parts", lambda *args: None)
        through_torch = Pair(ckpt, weights)

    def projections(runner: Any) -> list[QuantizedLinear]:
        model = runner.model
        linears = [getattr(layer, n) for layer in model.layers for n in PROJECTIONS]
        return [*linears, model.lm_head]

    for new, old in zip(
        projections(one_pass.native), projections(through_torch.native), strict=True
    ):
        assert [p.format for p in new.parts] == [p.format for p in old.parts]
        for a, b in zip(new.parts, old.parts, strict=True):
            assert a.interleaved == b.interleaved and torch.equal(a.data, b.data)
    arena = one_pass.native.model._weight_arena
    assert arena is not None
    start, stop = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.buffer.numel()
    for linear in projections(one_pass.native):
        assert all(start <= p.data.data_ptr() < stop for p in linear.parts)

    class Runners:
        runners = [one_pass.native, through_torch.native]

    new_logits, old_logits = _run_both(Runners(), 4, PROMPTS)  # type: ignore[arg-type]
    for a, b in zip(new_logits, old_logits, strict=True):
        assert torch.equal(a, b)
