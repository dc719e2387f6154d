"""A CPU KV pool must fit in the memory left beside the weights.

The pool is allocated unwritten (executor/kv_pool.py), so a pool larger than the machine's
memory starts without complaint and ends the process when load first fills it. Refusing it at
start-up says so while the operator is watching, as vLLM refuses a cache that cannot fit.
"""

from __future__ import annotations

from pathlib import Path

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.executor.cpu.dense_budget import MEMINFO, available_bytes

GB = 1e9


def check_pool_fits(
    config: EngineConfig, pool_bytes: int, weight_bytes: int, meminfo: Path = MEMINFO
) -> None:
    """ConfigError when ``pool_bytes`` exceed what the OS reports available less
    ``weight_bytes`` (the weights about to be packed); nothing where the OS does not say."""
    available = available_bytes(meminfo)
    if available is None:
        return
    left = available - weight_bytes
    if pool_bytes <= left:
        return
    key = "kv_cache_bytes" if config.kv_cache_bytes is not None else "kv_cache_tokens"
    raise ConfigError(
        f"config key {key!r}: the KV pool takes {pool_bytes / GB:.1f} GB, more than the "
        f"{max(0, left) / GB:.1f} GB of memory available beside the weights "
        f"({weight_bytes / GB:.1f} GB), and a full pool would end the process: lower "
        f"{key}"
    )
