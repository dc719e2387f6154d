"""The dense copies' default budget on a CPU, where the config gives none.

Above its crossover a quantized projection with no int8 or AMX product for its format and
activations here builds a dense copy and keeps it (executor/layers/linear.py, ``DenseBudget``):
2 bytes a weight in bfloat16 against a Q4_K_M file's ~0.6, so an 8B's (~15 GB beside its 5 GB)
would not fit in 24 GB and its first long prompt would end the process. So by default the
copies may take a share of the memory the OS reports available when the model is bound, less
the weights about to be packed and the KV pool (its pages are mapped in as requests first write
them, so the OS counts them as available until then); past it a projection keeps its quantized products (slower on
many rows, never wrong).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("asyncengine.executor")

# The share of the memory left available the dense copies may take (the rest: the steps'
# activations, the int8 panels' own share of this budget, other processes)
AVAILABLE_SHARE = 0.5
MEMINFO = Path("/proc/meminfo")


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The OS's MemAvailable (free memory plus what it can reclaim); None where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == "MemAvailable":
                return int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_dense_weight_bytes(
    weight_bytes: int, meminfo: Path = MEMINFO, *, kv_pool_bytes: int = 0
) -> int | None:
    """``AVAILABLE_SHARE`` of what is available less ``weight_bytes`` (the weights still to be
    packed into memory of their own) and ``kv_pool_bytes`` (the pool, not yet written); None
    (no bound) where the OS does not say."""
    available = available_bytes(meminfo)
    if available is None:
        return None
    budget = int(max(0, available - weight_bytes - kv_pool_bytes) * AVAILABLE_SHARE)
    log.info("dense copies of quantized projections: up to %.1f GB", budget / 1e9)
    return budget
