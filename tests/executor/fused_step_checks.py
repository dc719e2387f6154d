"""The fused native decode step against the torch path of the same weights, as the per-family
tests ask it (test_native_decode_qwen3.py, test_native_decode_gemma3.py): over Q8_0 blocks, over
F32 rows against the dense torch path, and with bfloat16 activations; each check also requires
every decode step to have been fused."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from asyncengine.executor.layers.linear import Linear, QuantizedLinear
from asyncengine.executor.loader import read_gguf
from asyncengine.kernels.cpu import decode_step_native, quant_i8gemm_native
from asyncengine.kernels.quant_formats import F32
from tests.conftest import TinyCheckpoint
from tests.executor.test_decode_step_bf16 import _assert_no_further_than, _teacher_forced
from tests.executor.test_gguf_shapes import make_hf, write_gguf
from tests.executor.test_native_decode import Pair, _compare, _count_fused_rows, _gguf_block


@contextlib.contextmanager
def step_built_with(flags: tuple[str, ...] | None) -> Iterator[None]:
    """Within it the float32 step's library is built with ``flags`` (None: as for this CPU)."""
    built = decode_step_native.KV_BUILD_FLAGS
    saved = built[torch.float32]
    if flags is not None:
        built[torch.float32] = flags
    decode_step_native._library.cache_clear()
    try:
        yield
    finally:
        built[torch.float32] = saved
        decode_step_native._library.cache_clear()


def q8_0_blocks(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every projection and the LM head as Q8_0 blocks, as a Q8_0 GGUF stores them."""
    return {
        name: _gguf_block(w, GGMLQuantizationType.Q8_0) if w.dim() == 2 else w
        for name, w in weights.items()
    }


def check_q8_0_step(
    ckpt: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]], steps: int
) -> Pair:
    """Same logits within the int8 activations' rounding, same greedy tokens, the same K at the
    same slots, every decode step fused. Answers the pair, for the caller's own checks."""
    pair = Pair(ckpt, q8_0_blocks(ckpt.load_weights()))
    rows = _count_fused_rows(pair.native, monkeypatch)
    _compare(pair, steps=steps, prompts=prompts)
    assert rows == [len(prompts)] * steps
    return pair


# two rows, the first past the tiny GGUFs' window of 16 before its decode steps
GGUF_PROMPTS = [[5, 17, 3, 90, 11, 40, 7, 8, 9, 10, 11, 12, 13, 14, 15], [9, 2, 33]]


def check_gguf_step(
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
) -> Pair:
    """A Q8_0 (or ``kind``) GGUF of the tiny model ``name`` (tests/executor/test_gguf_shapes.py),
    written as llama.cpp's converter writes it and read as the engine reads it: its projections
    stay blocks of that kind and 8 decode steps are fused and follow the torch path. Answers the
    pair."""
    path = tmp_path / f"{name}-{kind.name}.gguf"
    write_gguf(name, make_hf(name, tmp_path / "hf"), path, kind)
    checkpoint = read_gguf(path, torch.float32, frozenset({int(kind)}))
    (tmp_path / "read").mkdir()  # the config as read from the file, where Pair reads one
    (tmp_path / "read" / "config.json").write_text(json.dumps(checkpoint.config))
    pair = Pair(TinyCheckpoint(f"{name}-{kind.name}", tmp_path / "read"), dict(checkpoint.weights))
    qkv = pair.native.model.layers[0].qkv
    assert isinstance(qkv, QuantizedLinear)
    assert all(p.format.gguf_type == kind for p in qkv.parts)
    rows = _count_fused_rows(pair.native, monkeypatch)
    _compare(pair, steps=8, prompts=GGUF_PROMPTS)
    assert rows == [len(GGUF_PROMPTS)] * 8
    return pair


def check_f32_step(
    ckpt: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]], steps: int
) -> None:
    """No activation quantized on either side: the fused step's logits are the oneDNN torch
    path's within float32 summation order."""
    pair = Pair(ckpt, ckpt.load_weights(), dense_reference=monkeypatch)
    qkv = pair.native.model.layers[0].qkv
    assert [part.format for part in qkv.parts] == [F32]  # type: ignore[union-attr]
    assert isinstance(pair.torch_path.model.layers[0].qkv, Linear)
    rows = _count_fused_rows(pair.native, monkeypatch)
    _compare(pair, steps=steps, prompts=prompts, tolerance=1e-4, int8_activations=False)
    assert rows == [len(prompts)] * steps


def check_bf16_step(
    ckpt: TinyCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    prompts: list[list[int]],
    steps: int,
    worst_noise: float = 1.25,
) -> None:
    """bfloat16 activations over Q8_0 blocks: every decode fused (float32 inside), no further
    from the float32 model's logits than the bfloat16 torch path (its worst step within
    ``worst_noise`` times the torch path's: _assert_no_further_than), and its greedy tokens the
    float32 model's wherever that model's top two logits stand further apart than the bfloat16
    paths stray (a tiny random model's bfloat16 tokens are otherwise near ties). The decodes
    are what is compared: both bfloat16 paths prefill on the group kernels (on the int8
    product's coarser activations the shared prefill tipped which path lands nearer the float32
    logits, a coin toss at this size; test_native_decode_odd_widths.py holds that prefill)."""
    weights = q8_0_blocks(ckpt.load_weights())
    monkeypatch.setenv(quant_i8gemm_native.ENABLE_ENV, "0")
    pair = Pair(ckpt, weights, dtype=torch.bfloat16)
    rows = _count_fused_rows(pair.native, monkeypatch)
    fused = _teacher_forced(pair.native, prompts, steps)
    assert rows == [len(prompts)] * steps
    torch_path = _teacher_forced(pair.torch_path, prompts, steps)
    reference = _teacher_forced(Pair(ckpt, weights).torch_path, prompts, steps)
    assert all(torch.isfinite(step).all() for step in fused)
    _assert_no_further_than(fused, torch_path, reference, worst_noise)
    clear = 0
    for got, want in zip(fused, reference, strict=True):
        top2 = want.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        stray = (got - want).abs().max(dim=-1).values
        sure = margin > 2 * stray  # no bfloat16 rounding of this size can swap the two
        clear += int(sure.sum())
        assert got.argmax(-1)[sure].tolist() == want.argmax(-1)[sure].tolist()
    assert clear >= 2 * len(prompts)  # a quarter of the (step, row) pairs at least
