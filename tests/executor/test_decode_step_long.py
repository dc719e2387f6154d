"""The fused decode step of one request at a long context (kernels/cpu/cpu_decode_step.c): its
attention is cut into split-K ranges of all the row's kv heads, the new K/V taken from
registers by every range and stored by the last one. The same row repeated in a batch of 8
(items of a kv head over the whole row, the K/V stored before any row attends) is the oracle:
the same logits within float32 summation order, and the same K/V in the pool (layer 0's bit for
bit, later layers' from inputs that differ in summation order), nothing else written. A
bfloat16 model decoding past Llama 3.2's original 8,192 positions is no further from its
float32 run than its torch path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine.executor.loader.quantized import quantize_int8
from tests.conftest import (
    LLAMA32_ROPE_SCALING,
    TINY_CONFIGS,
    TinyCheckpoint,
    make_tiny_checkpoint,
)
from tests.executor.test_decode_step_bf16 import _assert_no_further_than, _teacher_forced
from tests.executor.test_native_decode import Pair, _count_fused_rows
from tests.native_support import needs_native

pytestmark = needs_native


@dataclass(frozen=True, slots=True)
class LongRow:
    """One request of ``keys`` keys for tiny_llama's fused step (int8 weights): every layer's
    random K/V, the row's pages in random order, its new key's slot and a hidden state."""

    model: Any  # the native DecodeStepModel
    num_layers: int
    page_size: int
    keys: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    table: torch.Tensor  # [1, pages]
    slot: int
    hidden: torch.Tensor  # [1, hidden]


def long_row(checkpoint: TinyCheckpoint, keys: int, dtype: torch.dtype = torch.float32) -> LongRow:
    pair = Pair(checkpoint, quantize_int8(checkpoint.load_weights()), max_len=keys)
    model = pair.native.model.native_decode
    assert model is not None
    c = pair.config
    page_size, pages = 16, -(-keys // 16) + 1
    gen = torch.Generator().manual_seed(keys)
    shape = (pages * page_size, c.num_kv_heads, c.head_dim)
    k = [torch.randn(shape, generator=gen).to(dtype) for _ in range(c.num_layers)]
    v = [torch.randn(shape, generator=gen).to(dtype) for _ in range(c.num_layers)]
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(1, pages)
    last = keys - 1  # the new key's position in the row; rotary at position 100 (any)
    slot = int(table[0, last // page_size]) * page_size + last % page_size
    hidden = torch.randn(1, c.hidden_size, generator=gen).to(dtype)
    return LongRow(model, c.num_layers, page_size, keys, k, v, table, slot, hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("keys", [600, 1101])
def test_one_long_row_is_the_same_row_in_a_batch(
    tiny_llama: TinyCheckpoint, threads: int, dtype: torch.dtype, keys: int
) -> None:
    row = long_row(tiny_llama, keys, dtype)

    def run(rows: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        k = [t.clone() for t in row.k]
        v = [t.clone() for t in row.v]
        row.model.bind_caches(k, v)
        out = row.model.step(
            row.hidden.expand(rows, -1).contiguous(),
            torch.full((rows,), 100),
            torch.full((rows,), row.slot),
            row.table.expand(rows, -1).contiguous(),
            torch.full((rows,), keys, dtype=torch.int32),
            row.page_size,
        )
        return out[:1].float(), k, v

    got, k_one, v_one = run(1)
    want, k_batch, v_batch = run(8)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
    assert torch.equal(k_one[0], k_batch[0]) and torch.equal(v_one[0], v_batch[0])
    for layer in range(1, row.num_layers):  # from inputs equal within summation order
        torch.testing.assert_close(k_one[layer], k_batch[layer], atol=1e-4, rtol=1e-2)
        torch.testing.assert_close(v_one[layer], v_batch[layer], atol=1e-4, rtol=1e-2)
        others = torch.ones(row.k[layer].shape[0], dtype=torch.bool)
        others[row.slot] = False
        assert torch.equal(k_one[layer][others], row.k[layer][others])


# Llama 3.2's RoPE (its scaled frequencies, base 500000) on a tiny model, room for 16k positions
LLAMA32_ROPE = {
    "tie_word_embeddings": True,
    "max_position_embeddings": 16384,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA32_ROPE_SCALING,
}


def test_a_bfloat16_runner_past_the_original_context_is_no_further_than_its_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 weights in bfloat16 with Llama 3.2's RoPE, decoding at positions 8,200-8,207 over
    2,000 pages: the fused step's logits are no further from the float32 run than the bfloat16
    torch path's. Each row's position picks its RoPE row as an integer (bfloat16 holds integers
    exactly only up to 256: a position carried in it is off by up to 16 here, ~15x the error)."""
    monkeypatch.setitem(TINY_CONFIGS, "llama32_rope", ("llama", LLAMA32_ROPE))
    ckpt = make_tiny_checkpoint("llama32_rope", tmp_path / "ckpt")
    weights = quantize_int8(ckpt.load_weights())
    prompt = torch.randint(3, 96, (8200,), generator=torch.Generator().manual_seed(0)).tolist()
    pair = Pair(ckpt, weights, dtype=torch.bfloat16, max_len=8300)
    rows = _count_fused_rows(pair.native, monkeypatch)
    fused = _teacher_forced(pair.native, [prompt], 8)
    assert rows == [1] * 8
    torch_path = _teacher_forced(pair.torch_path, [prompt], 8)
    reference = _teacher_forced(Pair(ckpt, weights, max_len=8300).torch_path, [prompt], 8)
    assert all(torch.isfinite(step).all() for step in fused)
    _assert_no_further_than(fused, torch_path, reference)
