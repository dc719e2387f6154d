"""The context the engine serves against the max_model_len a config asks for."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from tests.fake_executor import FakeExecutor


def core_for(
    asked: int | None,
    pool_tokens: int | None,
    model_len: int,
    token_bytes: int = 1,
    pool_bytes: int | None = None,
) -> EngineCore:
    values: dict[str, object] = {
        "page_size": 4,
        "kv_cache_tokens": pool_tokens,
        "kv_cache_bytes": pool_bytes,
        "log_interval": 0,
    }
    if asked is not None:
        values["max_model_len"] = asked
    executor = FakeExecutor(model_len)
    executor.spec = dataclasses.replace(executor.spec, kv_bytes_per_token=token_bytes)
    return build_core(EngineConfig.from_dict(values), executor)


def cut_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_context_set_past_the_pool_is_refused() -> None:
    """As vLLM: a max_model_len the operator set that one sequence cannot fill in the pool is a
    ConfigError naming both keys, the pool that would hold it and the context the pool holds
    (the asked context taken up to the model's)."""
    with pytest.raises(ConfigError) as refused:
        core_for(4096, pool_tokens=256, model_len=8192, token_bytes=1_000_000)
    assert str(refused.value) == (
        "config key 'max_model_len' = 4096: one sequence of 4096 tokens does not fit the KV "
        "pool of 256 tokens (kv_cache_tokens = 256); set 'kv_cache_tokens' to at least 4096 "
        "(a pool of 4.10 GB) or 'max_model_len' to at most 256"
    )
    with pytest.raises(ConfigError, match="one sequence of 8192 tokens .* at least 8192"):
        core_for(9999, pool_tokens=256, model_len=8192)
    with pytest.raises(ConfigError, match=r"pool of 256 tokens \(kv_cache_bytes = 256\)"):
        core_for(257, pool_tokens=None, model_len=8192, pool_bytes=256)
    assert core_for(256, pool_tokens=256, model_len=8192).max_model_len == 256  # it fits


def test_a_context_past_the_model_is_cut_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncengine.core.builder"):
        assert core_for(4096, pool_tokens=8192, model_len=2048).max_model_len == 2048
    assert cut_warnings(caplog) == ["max_model_len 4096 is cut to 2048 tokens, the model's context"]


def test_the_models_context_cut_by_the_pool_is_said_in_an_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="asyncengine.core.builder"):
        assert core_for(None, pool_tokens=256, model_len=2048).max_model_len == 256
        assert core_for(None, pool_tokens=8192, model_len=2048).max_model_len == 2048
    assert [r.getMessage() for r in caplog.records if r.name == "asyncengine.core.builder"] == [
        "the model's context of 2048 tokens is served as 256, what the KV pool holds "
        "(kv_cache_tokens, kv_cache_bytes or, on a GPU, gpu_memory_utilization size it)"
    ]


def test_a_context_that_fits_or_was_not_asked_for_is_not_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncengine.core.builder"):
        assert core_for(1024, pool_tokens=8192, model_len=2048).max_model_len == 1024
        assert core_for(None, pool_tokens=256, model_len=2048).max_model_len == 256
    assert cut_warnings(caplog) == []
