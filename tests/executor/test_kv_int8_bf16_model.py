"""A bfloat16 model over an int8 pool (``kv_cache_dtype = "int8"`` beside bfloat16 activations),
teacher-forced through every path that writes or reads the pool, against the float32 model
over a float32 pool: a batched prefill, a second chunk that reads its prefix from the pool,
decodes of 6 rows (rotary + store, then the paged decode attention) and of 2 rows (the fused
decode step), and deterministic mode. Head dim 64 takes the native kernels (the extend kernel's
bfloat16 queries over int8 keys, the decode kernel's widened queries); head dim 16 the torch
references (the pool dequantized to bfloat16) and deterministic mode's torch attention.

The measure is a step's largest logit difference over its largest |logit|. Both the int8 pool
and the bfloat16 model move the logits: LOGIT_TOLERANCE bounds it (measured at most 0.052 at
head dim 64 and 0.018 at 16), and it stays within PAST_BF16 times what the bfloat16 model over
its own bfloat16 pool moves them (measured up to 1.7x)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import Segment
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.runner import ModelRunner
from tests.executor.test_native_decode import _count_fused_rows, _plan
from tests.native_support import needs_native
from tests.server_support import tiny_model_dir

pytestmark = needs_native
I8, BF16, F32 = torch.int8, torch.bfloat16, torch.float32
LOGIT_TOLERANCE = 0.08
PAST_BF16 = 2.0
ROWS, PAGES, PAGE_SIZE = 6, 24, 16
PROMPT_LENS = [40, 77, 130, 16, 150, 64]
CHUNK, DECODES = 20, 4
# head dim 64: the native kernels; 16: the torch references (no native kernel takes it)
SHAPES = {
    "head-dim-64": {"hidden_size": 256, "intermediate_size": 256, "initializer_range": 0.1},
    "head-dim-16": {"initializer_range": 0.1},
}


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    total = CHUNK + 2 * DECODES
    return [torch.randint(3, 49000, (n + total,), generator=gen).tolist() for n in PROMPT_LENS]


def _runner(
    model: Path, dtype: torch.dtype, kv_dtype: torch.dtype, deterministic: bool = False
) -> ModelRunner:
    config = ModelConfig.from_hf_dict(json.loads((model / "config.json").read_text()))
    pool = KVPool(
        config.num_layers, config.num_kv_heads, config.head_dim, ROWS * PAGES, PAGE_SIZE, kv_dtype
    )
    table = PageTable(ROWS, PAGES)
    order = np.random.default_rng(0).permutation(ROWS * PAGES)  # pages scattered over the pool
    for row in range(ROWS):
        table.set_pages(row, 0, order[row * PAGES : (row + 1) * PAGES])
    weights = dict(load_file(model / "model.safetensors"))
    return ModelRunner(config, weights, pool, table, dtype, deterministic=deterministic)


def _teacher_forced(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Each path's logits (float32) over the same tokens."""
    seqs, out = _sequences(), {}
    with torch.inference_mode():
        prompts = [
            Segment(f"r{i}", i, s[:n], 0, True)
            for i, (s, n) in enumerate(zip(seqs, PROMPT_LENS, strict=True))
        ]
        out["prefill"] = runner.forward_logits(_plan(0, prompts, [])).float()
        chunks = [
            Segment(f"r{i}", i, s[n : n + CHUNK], n, True)
            for i, (s, n) in enumerate(zip(seqs, PROMPT_LENS, strict=True))
        ]
        out["prefix chunk"] = runner.forward_logits(_plan(1, chunks, [])).float()
        pos = [n + CHUNK for n in PROMPT_LENS]
        step = 2
        for name, rows in (("decode 6 rows", ROWS), ("decode 2 rows", 2)):
            logits = []
            for _ in range(DECODES):
                decodes = [
                    Segment(f"r{i}", i, [seqs[i][pos[i]]], pos[i], True) for i in range(rows)
                ]
                logits.append(runner.forward_logits(_plan(step, [], decodes)).float())
                pos[:rows] = [p + 1 for p in pos[:rows]]
                step += 1
            out[name] = torch.stack(logits)
    return out


def _moves(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_bfloat16_model_over_an_int8_pool_follows_float32(
    tmp_path_factory: pytest.TempPathFactory, shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model_dir(tmp_path_factory, **SHAPES[shape])
    ref = _teacher_forced(_runner(model, F32, F32))
    bf16_pool = _moves(_teacher_forced(_runner(model, BF16, BF16)), ref)
    runner = _runner(model, BF16, I8)
    assert runner.kv_pool.dtype == I8 and runner.model.native_decode is not None
    fused_rows = _count_fused_rows(runner, monkeypatch)
    int8_pool = _moves(_teacher_forced(runner), ref)
    assert fused_rows == [2] * DECODES  # 6 rows take rotary + store and the paged attention
    for path, move in int8_pool.items():
        assert move < LOGIT_TOLERANCE, (path, move)
        assert move < PAST_BF16 * bf16_pool[path], (path, move, bf16_pool[path])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_deterministic_mode_reads_an_int8_pool_beside_bfloat16(
    tmp_path_factory: pytest.TempPathFactory, shape: str
) -> None:
    """Its native extend kernel (head dim 64) or its torch attention (16), decodes included."""
    model = tiny_model_dir(tmp_path_factory, **SHAPES[shape])
    ref = _teacher_forced(_runner(model, F32, F32))
    bf16_pool = _moves(_teacher_forced(_runner(model, BF16, BF16, deterministic=True)), ref)
    int8_pool = _moves(_teacher_forced(_runner(model, BF16, I8, deterministic=True)), ref)
    for path, move in int8_pool.items():
        assert move < LOGIT_TOLERANCE, (path, move)
        assert move < PAST_BF16 * bf16_pool[path], (path, move, bf16_pool[path])
