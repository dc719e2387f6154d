"""A float16 K/V pool read and written by the native kernels' -DKV_F16 builds (kernels/cpu/cpu_kv.h):
decode, extend and the fused step's attention against the torch references over the same pool
(which widen its halves to float32: both sides then compute in float32 on the same values, so
the float32 tolerance holds), and the rotary + store pass against apply_rotary + store_kv (bit
for bit: float32 rotation, one rounding to half)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncengine.kernels.cpu import cpu_native, decode_step_native, layer_ops_native
from asyncengine.kernels.cpu.attention_native import (
    extend_kernel_runs,
    native_decode_attention,
    native_extend_attention,
    plan_native_decode,
    plan_native_extend,
)
from asyncengine.kernels.reference.attention_ref import decode_attention, extend_attention
from asyncengine.kernels.reference.kv_store_ref import store_kv
from asyncengine.kernels.reference.rotary_ref import apply_rotary
from tests.kernels.test_kernels_ref import TOLERANCE, PagedKV, naive_attention
from tests.native_support import needs_native

pytestmark = needs_native
F16, F32 = torch.float16, torch.float32
ATOL = TOLERANCE[F32]


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_the_float16_builds_load_and_say_so() -> None:
    for name in cpu_native.KV_LIBRARIES:
        lib = cpu_native.load(name, cpu_native.kv_flags(F16))
        assert lib is not None, name
        assert lib.asyncengine_kv_element() in (2, 18)  # 18: through F16C
        default = cpu_native.load(name)
        assert default is not None and default.asyncengine_kv_element() == 4
    f16c = "f16c" in Path("/proc/cpuinfo").read_text().split()
    assert cpu_native.kv_f16_native() == f16c


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [(9, 3, 64, 16), (4, 4, 32, 1), (8, 2, 128, 16), (16, 1, 64, 7), (6, 2, 96, 5)],
)
def test_native_decode_reads_a_float16_pool(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, threads: int
) -> None:
    seq_lens = [1, 31, 32, 33, 70, 5, 129, 64]
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, F16, seed=head_dim + page_size)
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(len(seq_lens), num_heads + 3, head_dim, generator=gen)
    q = wide[:, :num_heads]
    scale = head_dim**-0.5
    plan = plan_native_decode(kv.block_table, kv.seq_lens, page_size, num_heads, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, scale)
    ref = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale)
    assert got.dtype == F32 and ref.dtype == F32
    assert torch.isfinite(got).all(), "read a slot no request owns"
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    for b in range(len(seq_lens)):
        want = naive_attention(q[b : b + 1], kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(got[b], want[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "seq_lens", [[40, 3, 100], [40, 3, 100, 17, 64, 65, 1, 33, 200, 9]], ids=["3", "10"]
)
def test_native_decode_window_and_softcap_over_float16(seq_lens: list[int]) -> None:
    kv = PagedKV(seq_lens, 16, 2, 64, F16, seed=5)
    q = torch.randn(len(seq_lens), 8, 64, generator=torch.Generator().manual_seed(3))
    plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, 8, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, 0.125, 7, 1.5)
    ref = decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125, 7, 1.5
    )
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_a_float16_pool_refuses_bfloat16_queries() -> None:
    kv = PagedKV([5], 16, 1, 64, F16, seed=0)
    plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, 2, kv.k_cache)
    assert plan is not None
    with pytest.raises(ValueError, match="float32 queries"):
        native_decode_attention(
            torch.zeros(1, 2, 64, dtype=torch.bfloat16), kv.k_cache, kv.v_cache, plan, 1.0
        )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [
        (9, 3, 64, 16),
        (4, 4, 64, 1),
        (8, 2, 128, 16),
        (16, 1, 64, 7),
        (8, 4, 256, 16),
        (10, 2, 64, 5),
    ],
)
def test_native_extend_reads_a_float16_pool(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int
) -> None:
    if not extend_kernel_runs(F16):
        pytest.skip("no AVX2 + FMA or AVX-512 here: extends take the torch path")
    seq_lens = [50, 300, 17, 64, 129, 33, 193]
    q_lens = [50, 120, 1, 33, 16, 33, 35]
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, F16, seed=head_dim + page_size)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    wide = torch.randn(
        int(cu[-1]), num_heads + 2, head_dim, generator=torch.Generator().manual_seed(2)
    )
    q = wide[:, :num_heads]
    scale = head_dim**-0.5
    plan = plan_native_extend(kv.block_table, cu, kv.seq_lens, page_size, num_heads, kv.k_cache)
    assert plan is not None
    got = native_extend_attention(q, kv.k_cache, kv.v_cache, plan, scale)
    ref = extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, cu, kv.seq_lens, page_size, scale
    )
    assert got.dtype == F32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), q_lens, strict=True)):
        want = naive_attention(q[start : start + n], kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(got[start : start + n], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [(9, 3, 64, 16), (16, 1, 64, 7), (12, 1, 120, 5), (6, 2, 20, 3), (40, 8, 32, 16)],
)
@pytest.mark.parametrize(
    "seq_lens",
    [[1, 31, 32, 33, 70, 5, 129, 64], [97], [40, 3, 65, 17, 250, 1, 96, 33, 12, 64, 31, 8, 77]],
)
def test_fused_step_attention_reads_a_float16_pool(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    threads: int,
) -> None:
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, F16, seed=head_dim)
    q = torch.randn(
        len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(page_size)
    )
    scale = head_dim**-0.5
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale)
    got = decode_step_native.group_attention(q, *args)
    ref = decode_attention(q, *args)
    assert torch.isfinite(got).all(), "read a slot no request owns"
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_rotary_store_rounds_k_and_v_into_a_float16_pool() -> None:
    n, heads, kv_heads, d, slots = 7, 6, 2, 64, 40
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen) * 3
    positions = torch.tensor([0, 5, 9, 100, 3, 77, 12])
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(128).float()[:, None] * freqs[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    slot_mapping = torch.tensor([3, 17, 0, 39, 8, 22, 31])
    k_cache = torch.full((slots, kv_heads, d), float("nan"), dtype=F16)
    v_cache = k_cache.clone()
    q = layer_ops_native.rotary_store(
        qkv, heads, kv_heads, positions, cos_sin, k_cache, v_cache, slot_mapping
    )
    q_all, k_all, v_all = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q_ref, k_ref = apply_rotary(
        q_all.view(n, heads, d), k_all.view(n, kv_heads, d), positions, cos_sin
    )
    want_k = torch.full_like(k_cache, float("nan"))
    want_v = want_k.clone()
    store_kv(want_k, want_v, k_ref, v_all.reshape(n, kv_heads, d), slot_mapping)
    assert q.dtype == F32
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=0)
    assert torch.equal(k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))
