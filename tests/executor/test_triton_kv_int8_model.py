"""A tiny model over an int8 K/V pool through the Triton backend (its fused rotary + KV store
quantizing, its attention kernels dequantizing on load), under the Triton interpreter (CPU):
against the same backend over a float32 pool, and against the torch backend over an int8 pool
(the same layout, read by the CPU's kernels). And which backends ``kv_cache_dtype = int8`` is
honoured with on CUDA."""

from __future__ import annotations

import os

# Before triton loads (tests/conftest.py sets it too): run the kernels in the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch

from asyncengine.common.config import ConfigError
from asyncengine.common.plan import BatchPlan
from asyncengine.executor.kv_dtype import pick_kv_dtype
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.runner import ModelRunner
from tests.conftest import TinyCheckpoint
from tests.executor.test_triton_model import MAX_LEN, NUM_ROWS, seg
from tests.paged_pool_support import nan_pool, shuffled_page_table

I8, F16, BF16, F32 = torch.int8, torch.float16, torch.bfloat16, torch.float32
CUDA = torch.device("cuda")
# largest logit difference over the largest logit: an int8 pool against a float32 one (measured
# 0.025 on llama_gqa, 0.013 on gemma2), and against the torch backend over the same int8 rows
QUANTIZED = 0.05
SAME_POOL = 1e-4


def runner(
    ckpt: TinyCheckpoint, page_size: int, pool_dtype: torch.dtype, backend: str
) -> ModelRunner:
    config = ModelConfig.from_hf_dict(ckpt.hf_config)
    table, num_pages = shuffled_page_table(NUM_ROWS, MAX_LEN, page_size, 7, spare_pages=3)
    if pool_dtype == I8:  # every row's scale a NaN until written
        pool = KVPool(
            config.num_layers, config.num_kv_heads, config.head_dim, num_pages, page_size, I8
        )
        pool.k.fill_(-1)
        pool.v.fill_(-1)
    else:
        pool = nan_pool(config, num_pages, page_size)
    return ModelRunner(config, ckpt.load_weights(), pool, table, F32, backend=backend)


def plans() -> list[BatchPlan]:
    """Prefills (c only its first chunk, unsampled), c's second chunk on a prefix that ends
    mid-page beside decodes, then decodes of all three."""
    rng = np.random.default_rng(11)
    full = {rid: rng.integers(3, 90, MAX_LEN).tolist() for rid in "abc"}
    steps = [
        BatchPlan(
            step=1,
            extends=[
                seg("a", 0, full["a"][:5], 0),
                seg("c", 2, full["c"][:12], 0, sample=False),
                seg("b", 1, full["b"][:23], 0),
            ],
        ),
        BatchPlan(
            step=2,
            extends=[seg("c", 2, full["c"][12:17], 12)],
            decodes=[seg("a", 0, [full["a"][5]], 5), seg("b", 1, [full["b"][23]], 23)],
        ),
    ]
    pos, rows = {"a": 6, "b": 24, "c": 17}, {"a": 0, "b": 1, "c": 2}
    for step in range(3, 5):
        steps.append(
            BatchPlan(step=step, decodes=[seg(r, rows[r], [full[r][p]], p) for r, p in pos.items()])
        )
        pos = {r: p + 1 for r, p in pos.items()}
    return steps


@pytest.mark.parametrize(("name", "page_size"), [("llama_gqa", 16), ("gemma2", 1)])
def test_int8_pool_through_triton_stays_near_the_float_pool(
    tiny_checkpoints: dict[str, TinyCheckpoint], name: str, page_size: int
) -> None:
    """Logits within QUANTIZED of the float pool's (relative to their largest), the same greedy
    token wherever the float pool's top two are 2 x QUANTIZED apart; within SAME_POOL of the
    torch backend's over an int8 pool (the same rows: only float32 rounding differs).
    llama_gqa: heads of 16, page 16; gemma2: heads of 64, page 1, windows and soft-caps."""
    ckpt = tiny_checkpoints[name]
    int8_triton = runner(ckpt, page_size, I8, "triton")
    float_triton = runner(ckpt, page_size, F32, "triton")
    int8_torch = runner(ckpt, page_size, I8, "torch")
    clear_rows = 0
    for plan in plans():
        got = int8_triton.forward_logits(plan)
        exact = float_triton.forward_logits(plan)
        same_pool = int8_torch.forward_logits(plan)
        scale = exact.abs().max()
        assert (got - exact).abs().max() <= QUANTIZED * scale
        assert (got - same_pool).abs().max() <= SAME_POOL * scale
        top = exact.topk(2, dim=-1).values
        clear = top[:, 0] - top[:, 1] > 2 * QUANTIZED * scale
        assert torch.equal(got.argmax(-1)[clear], exact.argmax(-1)[clear])
        clear_rows += int(clear.sum())
    assert clear_rows >= 4  # the greedy check compared tokens (5 of 11 rows on llama_gqa)


def test_int8_on_cuda_is_read_by_the_triton_backend_only() -> None:
    for dtype in (F32, BF16):
        for backend in ("auto", "triton"):
            got = pick_kv_dtype("int8", CUDA, dtype, False, False, backend=backend)
            assert got == I8
    # auto keeps the model's dtype on CUDA: nothing measured there yet
    assert pick_kv_dtype("auto", CUDA, BF16, False, False, backend="triton", head_dim=64) == BF16
    refused = [
        (BF16, "flashinfer", "'flashinfer' does not read an int8 pool on cuda"),
        (BF16, "torch", "'torch' does not read an int8 pool on cuda"),
        (F16, "triton", "beside float32 or bfloat16 activations only"),
    ]
    for dtype, backend, why in refused:
        with pytest.raises(ConfigError, match=f"'kv_cache_dtype' = 'int8': .*{why}"):
            pick_kv_dtype("int8", CUDA, dtype, False, False, backend=backend)
    with pytest.raises(ConfigError, match="on mps no attention kernel reads an int8 pool"):
        pick_kv_dtype("int8", torch.device("mps"), BF16, False, False)
