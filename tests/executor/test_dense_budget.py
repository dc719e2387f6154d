"""``dense_weight_bytes``: the dense copies of quantized projections take at most that many bytes
together; a projection refused one keeps its quantized product at every row count, with the same
rows as without a dense copy (a float model's own rows multiply as stored); None bounds them on
a CPU by the memory the OS says is available."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.cpu import dense_budget
from asyncengine.executor.layers.linear import DenseBudget, QuantizedLinear
from asyncengine.executor.loader import DEFAULT_MODEL
from asyncengine.executor.model_executor import ModelExecutor, model_core
from asyncengine.kernels.quant_formats import I8, float_rows
from tests.kernels.test_quantized_kernels import random_weight
from tests.native_support import needs_native
from tests.server_support import tiny_model_dir

pytestmark = needs_native
ROWS, COLS = 40, 64


def linear(budget: DenseBudget | None, seed: int = 0) -> QuantizedLinear:
    """I8 rows (which the int8 product does not take): from 4 rows the dense copy, where the
    budget has room."""
    return QuantizedLinear([random_weight(I8, ROWS, COLS, seed)], None, 4, budget=budget)


def test_no_room_keeps_the_quantized_product() -> None:
    x = torch.randn(8, COLS)
    bounded, free = linear(DenseBudget(0)), linear(None)
    out = bounded(x)
    assert bounded._dense is None
    assert torch.equal(out, free._quantized(x))  # the quantized rows, not a dense copy's
    free(x)
    assert free._dense is not None  # no budget: the copy is built past the crossover


def test_copies_are_built_while_the_budget_has_room() -> None:
    nbytes = ROWS * COLS * 4  # a float32 copy
    budget = DenseBudget(nbytes + nbytes // 2)
    first, second = linear(budget, 0), linear(budget, 1)
    x = torch.randn(8, COLS)
    first(x)
    second(x)
    assert first._dense is not None and second._dense is None
    assert budget.left == nbytes // 2
    first(x)  # a copy already built takes nothing more
    assert budget.left == nbytes // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_models_rows_refused_a_copy_multiply_as_stored(dtype: torch.dtype) -> None:
    """A float32 (bfloat16) model's own rows need no copy for the dense product: refused one,
    many-row steps multiply the stored bytes (not the rows kernel, 3-16x slower there)."""
    weight = torch.randn(ROWS, COLS).to(dtype)
    bounded = QuantizedLinear([float_rows(weight)], None, 4, budget=DenseBudget(0))
    x = torch.randn(8, COLS).to(dtype)
    out = bounded(x)
    assert bounded._dense is not None and bounded._dense.packed is None
    assert bounded._dense.weight is not None
    assert bounded._dense.weight.data_ptr() == bounded.parts[0].data.data_ptr()  # no copy
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))
    roomy = QuantizedLinear([float_rows(weight)], None, 4, budget=DenseBudget(1 << 20))
    roomy(x)
    assert roomy._dense is not None and roomy._dense.packed is not None  # prepacked: faster


def test_a_negative_budget_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="dense_weight_bytes"):
        EngineConfig(dense_weight_bytes=-1)


def test_the_engine_honours_the_key() -> None:
    # 80 prompt tokens: past every crossover of the embedded model's Q4_1 / Q8_0 projections
    async def run() -> list[QuantizedLinear]:
        config = EngineConfig(
            model=DEFAULT_MODEL, device="cpu", kv_cache_tokens=512, dense_weight_bytes=0
        )
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        async with AsyncEngine(config) as engine:
            await engine.generate(list(range(3, 83)), params)
            model = engine.executor.runner.model
            return [
                p
                for layer in model.layers
                for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
                if isinstance(p, QuantizedLinear)
            ] + [model.lm_head]

    linears = asyncio.run(run())
    assert linears and all(p._dense is None for p in linears)


def test_a_dense_checkpoint_has_no_budget_and_logs_none(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A float checkpoint's projections are packed as they load, never copied: the start-up
    says nothing of dense copies (the embedded GGUF's line says how many it may make)."""
    caplog.set_level(logging.INFO, logger="asyncengine.executor")
    model_dir = tiny_model_dir(tmp_path_factory)
    dense = EngineConfig(model=str(model_dir), device="cpu", kv_cache_tokens=256)
    core, _ = model_core(dense)
    assert core.executor.runner.model.dense_budget is None
    assert "dense copies" not in caplog.text
    model_core(EngineConfig(model=DEFAULT_MODEL, device="cpu", kv_cache_tokens=256))
    assert "dense copies of quantized projections: up to" in caplog.text


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24681012 kB\nMemAvailable:    8000000 kB\nBuffers: 1 kB\n")
    assert dense_budget.available_bytes(meminfo) == 8_000_000 * 1024
    # half of what is left once the weights are packed; none left: no copies
    assert dense_budget.default_dense_weight_bytes(1_000_000 * 1024, meminfo) == 3_500_000 * 1024
    assert dense_budget.default_dense_weight_bytes(9_000_000 * 1024, meminfo) == 0
    pooled = dense_budget.default_dense_weight_bytes(
        1_000_000 * 1024, meminfo, kv_pool_bytes=2_000_000 * 1024
    )
    assert pooled == 2_500_000 * 1024  # the pool's bytes are not the copies' to take
    meminfo.write_text("MemTotal: 1 kB\n")
    assert dense_budget.available_bytes(meminfo) is None
    assert dense_budget.default_dense_weight_bytes(0, meminfo) is None  # no bound where unknown
    assert dense_budget.available_bytes(tmp_path / "missing") is None


def test_without_the_key_the_budget_is_the_memory_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is left beside the weights and the KV pool: the pool is unwritten when the budget is
    set, so the OS still counts its bytes as available, and copies sized without it would
    leave a full pool no room."""
    monkeypatch.setattr(dense_budget, "available_bytes", lambda meminfo=None: 3 << 30)
    unset = EngineConfig(model=DEFAULT_MODEL, device="cpu", kv_cache_tokens=8192)
    core, _ = model_core(unset)
    budget = core.executor.runner.model.dense_budget
    weights = ModelExecutor(unset).weight_bytes  # the bytes the bind packed
    pool = core.executor.runner.kv_pool.nbytes
    assert pool > 50 << 20  # large enough to matter
    assert budget is not None and budget.left == ((3 << 30) - weights - pool) // 2
    given = EngineConfig(
        model=DEFAULT_MODEL, device="cpu", kv_cache_tokens=256, dense_weight_bytes=7
    )
    core, _ = model_core(given)
    assert core.executor.runner.model.dense_budget.left == 7
