"""The one rule of which activations a CPU K/V pool sits beside (kernels/pool_pairs.py), as the
config check, the runner and the kernels' bindings apply it."""

from __future__ import annotations

import pytest
import torch

from asyncengine.common.config import ConfigError
from asyncengine.executor.kv_dtype import pick_kv_dtype
from asyncengine.kernels.cpu import layer_ops_native
from asyncengine.kernels.pool_pairs import beside_what, pool_fits
from tests.native_support import needs_native

F32, BF16, F16, I8 = torch.float32, torch.bfloat16, torch.float16, torch.int8
CPU = torch.device("cpu")
# (pool, activations) -> read and written together on a CPU
TABLE = {
    (F32, F32): True,
    (BF16, BF16): True,
    (F16, F16): True,
    (F16, F32): True,
    (F16, BF16): False,
    (I8, F32): True,
    (I8, BF16): True,
    (I8, F16): False,
    (F32, BF16): False,
    (BF16, F32): False,
}


@pytest.mark.parametrize(("pool", "activations"), list(TABLE))
def test_pool_fits_the_table(pool: torch.dtype, activations: torch.dtype) -> None:
    assert pool_fits(pool, activations) == TABLE[(pool, activations)]


def test_messages_name_the_activations() -> None:
    assert beside_what(I8) == "float32 or bfloat16"
    assert beside_what(F16) == "float32"


@pytest.mark.parametrize(("name", "activations"), [("int8", F16), ("float16", BF16)])
def test_the_config_refuses_what_the_rule_refuses(name: str, activations: torch.dtype) -> None:
    with pytest.raises(ConfigError, match=f"beside {beside_what(getattr(torch, name))}"):
        pick_kv_dtype(name, CPU, activations, quantized=True, deterministic=False)


@needs_native
def test_rotary_store_refuses_a_pool_the_rule_refuses() -> None:
    qkv = torch.zeros(2, (2 + 2 * 1) * 64, dtype=BF16)
    cache = torch.zeros(16, 1, 64, dtype=F16)
    cos_sin = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="caches must be"):
        layer_ops_native.rotary_store(
            qkv, 2, 1, torch.arange(2), cos_sin, cache, cache.clone(), torch.arange(2)
        )
