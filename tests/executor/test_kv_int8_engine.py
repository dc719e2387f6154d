"""``kv_cache_dtype = "int8"`` in the engine: which combinations are refused at start-up, the
pool's tokens per byte against float16 / bfloat16, and a tiny model served over an int8 pool
through prefix caching, chunked prefills, retraction with swap, and the KV invariant: in float32
(head dim 16: the torch references) and in bfloat16 (head dim 64: the native kernels with
bfloat16 queries)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.common.config import ConfigError
from asyncengine.core.builder import build_core
from asyncengine.executor.kv_dtype import pick_kv_dtype
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.model_executor import ModelExecutor
from tests.conftest import TinyCheckpoint
from tests.executor.test_deterministic_engine import OUTPUT, greedy, workload
from tests.native_support import needs_native
from tests.server_support import engine_config, tiny_model_dir

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# the model's dtype -> the tiny checkpoint's overrides (tiny_model_dir)
MODELS: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"hidden_size": 256, "intermediate_size": 256, "initializer_range": 0.1},
}
I8, F16, BF16, F32 = torch.int8, torch.float16, torch.bfloat16, torch.float32


def test_int8_is_honoured_beside_float32_or_bfloat16_activations_on_a_cpu() -> None:
    """(On CUDA: tests/executor/test_triton_kv_quant_model.py.)"""
    for dtype in (F32, BF16):
        assert pick_kv_dtype("int8", CPU, dtype, quantized=True, deterministic=False) == I8
        assert pick_kv_dtype("int8", CPU, dtype, quantized=False, deterministic=False) == I8
        assert pick_kv_dtype("int8", CPU, dtype, quantized=True, deterministic=True) == I8
        assert (
            pick_kv_dtype("int8", CPU, dtype, quantized=True, deterministic=False, backend="torch")
            == I8
        )
    refused = [
        (CUDA, BF16, False, "flashinfer", "only the Triton kernels read an int8 pool"),
        (CPU, F16, False, "auto", "beside float32 or bfloat16 activations only"),
        (CPU, F32, False, "triton", "'triton' does not read an int8 pool on cpu"),
        (CPU, BF16, False, "triton", "'triton' does not read an int8 pool on cpu"),
        (CPU, F32, False, "flashinfer", "'flashinfer' does not read an int8 pool on cpu"),
        (CPU, BF16, True, "flashinfer", "'flashinfer' does not read an int8 pool on cpu"),
    ]
    for device, dtype, deterministic, backend, why in refused:
        with pytest.raises(ConfigError, match=f"'kv_cache_dtype' = 'int8'.*{why}"):
            pick_kv_dtype(
                "int8", device, dtype, quantized=True, deterministic=deterministic, backend=backend
            )


def test_fp8_on_a_cpu_is_a_config_error_that_says_why() -> None:
    """(On CUDA: tests/executor/test_triton_kv_quant_model.py.)"""
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="'kv_cache_dtype' = 'fp8': on cpu no attention kernel"):
        pick_kv_dtype("fp8", CPU, BF16, quantized=False, deterministic=False)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_holds_at_least_1_9x_the_tokens_of_bfloat16(head_dim: int) -> None:
    budget = 64 << 20
    pages = {
        dtype: KVPool.num_pages_for_bytes(budget, 30, 3, head_dim, 16, dtype)
        for dtype in (I8, BF16, F16)
    }
    assert pages[BF16] == pages[F16]
    assert pages[I8] >= 1.9 * pages[BF16]
    pool = KVPool(2, 3, head_dim, 4, 16, I8)
    assert pool.k.shape == (2, 64, 3, head_dim + 2)
    assert pool.nbytes == 4 * 16 * pool.bytes_per_token


@needs_native
def test_kv_cache_bytes_buys_int8_pages(tiny_llama: TinyCheckpoint) -> None:
    def core(kv: str) -> Any:
        config = EngineConfig(
            model=str(tiny_llama.path),
            dtype="float32",
            kv_cache_dtype=kv,
            log_interval=0,
            kv_cache_bytes=1 << 20,
        )
        return build_core(config, ModelExecutor(config))

    pages = {kv: core(kv).scheduler.kv.num_pages for kv in ("float16", "int8")}
    head_dim = tiny_llama.hf_config["hidden_size"] // tiny_llama.hf_config["num_attention_heads"]
    assert pages["int8"] * (head_dim + 2) <= pages["float16"] * 2 * head_dim + 2 * (head_dim + 2)
    assert pages["int8"] > pages["float16"]


def _prompts() -> list[list[int]]:
    shared = [(7 * i + 3) % 900 + 5 for i in range(70)]  # a shared prefix: the radix cache
    return [shared[: 20 + 9 * i] + [(31 * i + j) % 900 + 5 for j in range(3 + i)] for i in range(6)]


async def _generate(model: str, **overrides: Any) -> tuple[list[list[int]], dict[str, Any]]:
    config = engine_config(model, kv_cache_dtype="int8", **overrides)
    async with AsyncEngine(config) as engine:
        assert engine.core.executor.runner.kv_pool.dtype == I8
        engine.step_hooks.append(lambda plan: engine.scheduler.kv.check_invariant())
        params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
        outs = await asyncio.gather(*(engine.generate(p, params) for p in _prompts()))
        engine.scheduler.kv.check_invariant()
        stats = engine.stats()
    return [o.token_ids for o in outs], stats


@needs_native
@pytest.mark.parametrize("dtype", list(MODELS))
def test_a_tiny_model_over_an_int8_pool_survives_swap_and_the_prefix_cache(
    tmp_path_factory: pytest.TempPathFactory, dtype: str
) -> None:
    """The same greedy tokens with a roomy pool and with one so small that requests are
    retracted and swapped out and back (the int8 rows and their scales copied as bytes),
    chunked prefills and prefix hits: a token's K/V quantize alone (per token and head), so
    however a prompt is split or shared its pool rows are the same. A bfloat16 model's products
    round differently with the batch's shape: its runs are deterministic mode's."""
    model = str(tiny_model_dir(tmp_path_factory, **MODELS[dtype]))
    invariant = dtype == "bfloat16"
    roomy, _ = asyncio.run(
        _generate(model, dtype=dtype, deterministic=invariant, kv_cache_tokens=4096)
    )
    tight, stats = asyncio.run(
        _generate(
            model,
            dtype=dtype,
            deterministic=invariant,
            kv_cache_tokens=192,
            page_size=4,
            chunked_prefill_size=16,
            max_prefill_tokens=32,
            init_new_token_ratio=0.05,
            min_new_token_ratio=0.01,
            preemption_mode="swap",
            # room for every request's KV at once, not the default 1 GiB: the KV invariant
            # checks each host page after every step
            swap_space_bytes=1 << 20,
        )
    )
    assert [len(t) for t in roomy] == [24] * len(roomy)
    assert stats["swap_outs"] > 0 and stats["swap_ins"] > 0 and stats["recomputed_tokens"] == 0
    assert stats["cache_hit_rate"] > 0
    assert tight == roomy


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", list(MODELS))
async def test_deterministic_mode_over_an_int8_pool(
    tmp_path_factory: pytest.TempPathFactory, dtype: str
) -> None:
    """Deterministic mode reads int8 rows too (each dequantized alone): the same greedy tokens
    alone and under load (chunked, retracted, beside others), as over its own dtype's pool."""
    config = engine_config(
        str(tiny_model_dir(tmp_path_factory, **MODELS[dtype])),
        dtype=dtype,
        kv_cache_dtype="int8",
        deterministic=True,
        chunked_prefill_size=32,
        max_prefill_tokens=64,
        max_model_len=512,
        kv_cache_tokens=512,
        init_new_token_ratio=0.1,
        min_new_token_ratio=0.1,
    )
    probes, load = workload()
    async with AsyncEngine(config) as engine:
        assert engine.core.executor.runner.kv_pool.dtype == I8
        alone = [(await engine.generate(p, greedy())).token_ids for p in probes]
        outs = await asyncio.gather(
            *(engine.generate(p, greedy(OUTPUT + i)) for i, p in enumerate(load[:6])),
            *(engine.generate(p, greedy()) for p in probes),
        )
        loaded = [o.token_ids for o in outs[6:]]
        stats = engine.stats()
    assert all(len(t) == OUTPUT for t in alone)
    assert loaded == alone
    assert stats["retractions"] >= 1
