"""A CPU KV pool larger than the memory left beside the weights is refused at start-up (its
pages are mapped in only as they are written: unrefused, the first load to fill it ends the
process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.executor.cpu import pool_fit
from asyncengine.executor.loader import DEFAULT_MODEL
from asyncengine.executor.model_executor import ModelExecutor, model_core
from tests.native_support import needs_native

MB = 1 << 20


def meminfo(tmp_path: Path, available_kb: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kb} kB\n")
    return path


def test_a_pool_past_the_memory_left_names_its_key(tmp_path: Path) -> None:
    info = meminfo(tmp_path, 1000 * 1024)  # 1000 MiB
    tokens = EngineConfig(kv_cache_tokens=1 << 20)
    pool_fit.check_pool_fits(tokens, 600 * MB, 400 * MB, info)  # exactly what is left
    with pytest.raises(ConfigError, match="'kv_cache_tokens'.*0.6 GB.*0.4 GB"):
        pool_fit.check_pool_fits(tokens, 600 * MB + 1, 400 * MB, info)
    with pytest.raises(ConfigError, match="'kv_cache_bytes'"):
        pool_fit.check_pool_fits(EngineConfig(kv_cache_bytes=1 << 40), 1 << 40, 0, info)
    # where the OS does not say, no bound
    pool_fit.check_pool_fits(tokens, 1 << 50, 0, tmp_path / "missing")


@needs_native
def test_the_engine_refuses_a_pool_it_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(model=DEFAULT_MODEL, device="cpu", kv_cache_tokens=32768)
    weights = ModelExecutor(config).weight_bytes
    monkeypatch.setattr(pool_fit, "available_bytes", lambda meminfo=None: weights + 64 * MB)
    with pytest.raises(ConfigError, match="kv_cache_tokens"):
        model_core(config)  # 32768 tokens of SmolLM2: over 350 MiB in any dtype
    model_core(config.replace(kv_cache_tokens=256))  # a pool that fits starts
