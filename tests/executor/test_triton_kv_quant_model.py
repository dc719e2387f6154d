"""A tiny model over an int8 or fp8 K/V pool through the Triton backend (its fused rotary + KV
store quantizing, its attention kernels dequantizing on load), under the Triton interpreter
(CPU): against the same backend over a float32 pool, and (int8) against the torch backend over an
int8 pool (the same layout, read by the CPU's kernels). On a GPU (skipped without one): the
same in bfloat16 with the compiled kernels, and a captured decode step over the pool. And where
``kv_cache_dtype = int8 / fp8`` is honoured on CUDA (the GPU's compute capability
monkeypatched)."""

from __future__ import annotations

import os

# Before triton loads (tests/conftest.py sets it too): run the kernels in the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from asyncengine.common.config import ConfigError
from asyncengine.executor.attention import selector
from asyncengine.executor.cpu import native_decode
from asyncengine.executor.kv_dtype import pick_kv_dtype
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.reference.kv_store_ref import copy_kv_slots
from tests.conftest import TinyCheckpoint
from tests.executor.test_triton_model import (
    MAX_LEN,
    NUM_ROWS,
    prefill_then_decode_plans,
    run_cuda_check,
)
from tests.paged_pool_support import nan_pool, shuffled_page_table

I8, FP8, F16, BF16, F32 = (
    torch.int8,
    torch.float8_e4m3fn,
    torch.float16,
    torch.bfloat16,
    torch.float32,
)
CUDA = torch.device("cuda")
# largest logit difference over the largest logit: a quantized pool against a float32 one
# (measured: int8 0.025 on llama_gqa, 0.013 on gemma2; fp8 0.07, 0.04), and an int8 one against
# the torch backend over the same int8 rows
QUANTIZED = {I8: 0.05, FP8: 0.3}
SAME_POOL = 1e-4
# where the CPU's decode attention takes Q.K in integers over an int8 pool (AVX-512 VNNI, heads of
# 32 and up: cpu_stream_i8_dots.h), its queries rounded to int8 per head: gemma2 measured 0.007
SAME_POOL_INT8_DOTS = 0.02


def runner(
    ckpt: TinyCheckpoint, page_size: int, pool_dtype: torch.dtype, backend: str
) -> ModelRunner:
    config = ModelConfig.from_hf_dict(ckpt.hf_config)
    table, num_pages = shuffled_page_table(NUM_ROWS, MAX_LEN, page_size, 7, spare_pages=3)
    if pool_dtype in (I8, FP8):  # every row's scale a NaN until written
        pool = KVPool(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            num_pages,
            page_size,
            pool_dtype,
        )
        pool.k.view(I8).fill_(-1)
        pool.v.view(I8).fill_(-1)
    else:
        pool = nan_pool(config, num_pages, page_size)
    return ModelRunner(config, ckpt.load_weights(), pool, table, F32, backend=backend)


@pytest.mark.parametrize(
    ("name", "page_size", "pool", "tolerance"),
    [("llama_gqa", 16, I8, 0.05), ("gemma2", 1, I8, 0.05), ("gemma2", 1, FP8, 0.08)],
)
def test_quantized_pool_through_triton_stays_near_the_float_pool(
    tiny_checkpoints: dict[str, TinyCheckpoint],
    name: str,
    page_size: int,
    pool: torch.dtype,
    tolerance: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Logits within ``tolerance`` of the float pool's, relative to their largest (measured:
    int8 0.025 on llama_gqa, 0.013 on gemma2; fp8 0.049 on gemma2), and the same greedy token on
    every row but near ties; an int8 pool's logits within SAME_POOL of the torch backend's over
    an int8 pool (the same rows: only float32 rounding differs; SAME_POOL_INT8_DOTS where the
    CPU rounds the queries to int8 for its integer Q.K). llama_gqa: heads of 16, page
    16; gemma2: heads of 64, page 1, windows and soft-caps. (fp8's 3 mantissa bits move 2 of 11
    tokens of llama_gqa's heads of 16, whose margins are 0.06 and 0.08.)"""
    # decode steps through the backend too, not the CPU's fused native decode step
    monkeypatch.setenv(native_decode.ENABLE_ENV, "0")
    ckpt = tiny_checkpoints[name]
    quantized = runner(ckpt, page_size, pool, "triton")
    float_pool = runner(ckpt, page_size, F32, "triton")
    same_pool = runner(ckpt, page_size, I8, "torch") if pool == I8 else None
    head_dim = ModelConfig.from_hf_dict(ckpt.hf_config).head_dim
    same_tolerance = SAME_POOL_INT8_DOTS if cpu_native.kv_i8_query_dots(head_dim) else SAME_POOL
    for plan in prefill_then_decode_plans():
        got = quantized.forward_logits(plan)
        exact = float_pool.forward_logits(plan)
        scale = exact.abs().max()
        assert (got - exact).abs().max() <= tolerance * scale
        if same_pool is not None:
            assert (got - same_pool.forward_logits(plan)).abs().max() <= same_tolerance * scale
        top = exact.topk(2, dim=-1).values
        no_tie = top[:, 0] - top[:, 1] > 1e-3 * scale
        assert torch.equal(got.argmax(-1)[no_tie], exact.argmax(-1)[no_tie])


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["int8", "fp8"])
def test_cuda_check_script_runs_on_cpu_under_the_interpreter(
    tiny_llama: TinyCheckpoint, pool: str
) -> None:
    """The GPU check below (test_triton_model.py's script with a quantized pool), on CPU in
    float32 (no graph capture): keeps it from rotting. (llama_gqa's heads of 16: fp8's error
    is ~5x int8's: measured 0.030 and 0.152.)"""
    figures = run_cuda_check(tiny_llama, "cpu", interpret=True, pool=pool)
    assert figures["backend_rel_diff"] < 1e-5
    assert figures["pool_rel_diff"] < (0.05 if pool == "int8" else 0.3)
    assert "graph_rel_diff" not in figures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pool", ["int8", "fp8"])
def test_quantized_pool_on_cuda_stays_near_the_bfloat16_pool_and_replays_in_a_graph(
    tiny_llama: TinyCheckpoint, pool: str
) -> None:
    """Compiled kernels (no interpreter) in bfloat16 over an int8 / fp8 pool on the GPU, then a
    captured decode step over it."""
    if pool == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 (e4m3) needs a GPU of compute capability 8.9 or newer")
    figures = run_cuda_check(tiny_llama, "cuda", interpret=False, pool=pool)
    assert figures["pool_rel_diff"] < (0.08 if pool == "int8" else 0.3)
    assert figures["graph_rel_diff"] < 1e-2
    assert figures["graph_greedy_wrong"] == 0.0


def test_int8_and_fp8_on_cuda_are_read_by_the_triton_backend_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))  # an H100
    for dtype in (F32, BF16):
        for backend in ("auto", "triton"):
            for name, pool in (("int8", I8), ("fp8", FP8)):
                assert pick_kv_dtype(name, CUDA, dtype, False, False, backend=backend) == pool
    # auto keeps the model's dtype on CUDA: nothing measured there yet
    assert pick_kv_dtype("auto", CUDA, BF16, False, False, backend="triton", head_dim=64) == BF16
    refused = [
        (BF16, "flashinfer", False, "attention_backend 'flashinfer' does not read it"),
        (BF16, "torch", False, "attention_backend 'torch' does not read it"),
        (BF16, "auto", True, "deterministic mode on cuda runs the torch attention backend"),
        (F16, "triton", False, "beside float32 or bfloat16 activations only"),
    ]
    for name in ("int8", "fp8"):
        for dtype, backend, deterministic, why in refused:
            with pytest.raises(ConfigError, match=f"'kv_cache_dtype' = '{name}': .*{why}"):
                pick_kv_dtype(name, CUDA, dtype, False, deterministic, backend=backend)
    with pytest.raises(ConfigError, match="on mps no attention kernel reads an int8 pool"):
        pick_kv_dtype("int8", torch.device("mps"), BF16, False, False)
    # without Triton, auto is the torch backend on CUDA: no quantized pool
    monkeypatch.setattr(selector, "_importable", lambda name: False)
    with pytest.raises(ConfigError, match="'auto' does not read it"):
        pick_kv_dtype("int8", CUDA, BF16, False, False)


@pytest.mark.parametrize(
    ("capability", "honoured"),
    [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)],
)
def test_fp8_needs_a_gpu_of_compute_capability_8_9(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], honoured: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert pick_kv_dtype("int8", CUDA, BF16, False, False) == I8  # int8 on any
    if honoured:
        assert pick_kv_dtype("fp8", CUDA, BF16, False, False) == FP8
        return
    major, minor = capability
    with pytest.raises(
        ConfigError, match=f"compute capability 8.9 or newer \\(this one is {major}.{minor}\\)"
    ):
        pick_kv_dtype("fp8", CUDA, BF16, False, False)


def test_an_fp8_pool_holds_int8_rows_and_copies_its_slots() -> None:
    """An fp8 pool's rows carry their scale as an int8 pool's do (the same bytes per token, so
    the simulator's memory model and KV budgets hold), and its slots copy (index_copy_ has no
    float8 kernel)."""
    fp8, int8 = KVPool(2, 3, 64, 4, 16, FP8), KVPool(2, 3, 64, 4, 16, I8)
    assert fp8.k.shape == int8.k.shape == (2, 64, 3, 66)
    assert fp8.bytes_per_token == int8.bytes_per_token
    k, v = fp8.k[0], fp8.v[0]
    k.view(I8).copy_(torch.randint(-100, 100, k.shape, dtype=I8))
    v.view(I8).copy_(torch.randint(-100, 100, v.shape, dtype=I8))
    before = (k.clone(), v.clone())
    copy_kv_slots(k, v, (torch.tensor([3, 9]), torch.tensor([40, 2])))
    for got, old in zip((k, v), before, strict=True):
        assert torch.equal(got[[40, 2]].view(I8), old[[3, 9]].view(I8))
        assert torch.equal(got[5].view(I8), old[5].view(I8))
