"""An int8 K/V pool read and written beside bfloat16 activations (a bfloat16 model's
``kv_cache_dtype = "int8"``): the native kernels' -DKV_I8 builds with bfloat16 queries and
outputs, on this CPU's widest ISA and forced to AVX2.

The oracle is float32 attention over the same int8 pool (the torch reference, the query widened
exactly). The kernels compute in float32 and round the output to bfloat16 (half a step: 2^-9
relative); the extend kernel also rounds each dequantized key (and, on AVX512-BF16 CPUs, value
and probability) to bfloat16 for its dot products, as over a bfloat16 pool. BF16_ATOL bounds
these for unit-variance K/V and outputs of magnitude ~1 (measured here: decode 0.007, extend
0.015 at most)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.kernels.cpu.attention_native import (
    extend_kernel_features,
    extend_kernel_runs,
    native_decode_attention,
    native_extend_attention,
    plan_native_decode,
    plan_native_extend,
)
from asyncengine.kernels.reference.attention_ref import decode_attention, extend_attention
from asyncengine.kernels.reference.kv_int8_ref import dequantize_kv
from tests.kernels.test_kernels_ref import naive_attention
from tests.kernels.test_kv_int8_kernels import (  # noqa: F401  (fixtures)
    INT8_ATOL,
    PagedInt8KV,
    isa,
    query_as_read,
    threads,
)
from tests.native_support import needs_native

pytestmark = needs_native
I8, BF16, F32 = torch.int8, torch.bfloat16, torch.float32
BF16_ATOL = 0.02
SHAPES = [(9, 3, 64, 16), (4, 4, 64, 1), (8, 2, 128, 16), (16, 2, 64, 7), (8, 4, 256, 5)]


def bf16_queries(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "page_size"), SHAPES)
@pytest.mark.parametrize("seq_lens", [[1, 31, 32, 33, 70, 5, 129, 64], [1500], [700, 2051]])
def test_native_decode_takes_bfloat16_queries_over_an_int8_pool(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    isa: str,
    threads: int,
) -> None:
    kv = PagedInt8KV(seq_lens, page_size, num_kv_heads, head_dim, seed=head_dim + page_size)
    q = bf16_queries((len(seq_lens), num_heads, head_dim), seed=1)
    scale = head_dim**-0.5
    plan = plan_native_decode(kv.block_table, kv.seq_lens, page_size, num_heads, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, scale)
    assert got.dtype == BF16 and torch.isfinite(got).all(), "read a slot no request owns"
    wide = q.float()
    ref = decode_attention(
        query_as_read(wide), kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale
    )
    torch.testing.assert_close(got.float(), ref, atol=BF16_ATOL, rtol=0)
    for b in range(len(seq_lens)):
        want = naive_attention(wide[b : b + 1], kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(got[b].float(), want[0], atol=INT8_ATOL + BF16_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("seq_lens", "window"), [([40, 3, 100], 7), ([1500], 700)], ids=["3", "split-K"]
)
def test_native_decode_window_and_softcap_with_bfloat16_queries(
    seq_lens: list[int],
    window: int,
    isa: str,
) -> None:
    kv = PagedInt8KV(seq_lens, 16, 2, 64, seed=5)
    q = bf16_queries((len(seq_lens), 8, 64), seed=3)
    plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, 8, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, 0.125, window, 1.5)
    ref = decode_attention(
        q.float(), kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125, window, 1.5
    )
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), ref, atol=BF16_ATOL, rtol=0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "page_size"), SHAPES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (40, 0.0), (0, 2.0)])
def test_native_extend_takes_bfloat16_queries_over_an_int8_pool(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    window: int,
    softcap: float,
    isa: str,
) -> None:
    if not extend_kernel_runs(I8):
        pytest.skip("no AVX2 + FMA or AVX-512 here: extends take the torch path")
    seq_lens = [50, 300, 17, 64, 129, 33, 193]
    q_lens = [50, 120, 1, 33, 16, 33, 35]
    kv = PagedInt8KV(seq_lens, page_size, num_kv_heads, head_dim, seed=head_dim + page_size)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    q = bf16_queries((int(cu[-1]), num_heads, head_dim), seed=2)
    scale = head_dim**-0.5
    plan = plan_native_extend(kv.block_table, cu, kv.seq_lens, page_size, num_heads, kv.k_cache)
    assert plan is not None
    got = native_extend_attention(q, kv.k_cache, kv.v_cache, plan, scale, window, softcap)
    assert got.dtype == BF16 and torch.isfinite(got).all()
    args = (kv.k_cache, kv.v_cache, kv.block_table, cu, kv.seq_lens, page_size, scale)
    ref = extend_attention(q.float(), *args, window, softcap)
    torch.testing.assert_close(got.float(), ref, atol=BF16_ATOL, rtol=0)
    # the torch reference with the bfloat16 queries themselves (the fallback where no kernel
    # runs: the pool dequantized to bfloat16, the fused attention in bfloat16)
    fallback = extend_attention(q, *args, window, softcap)
    assert fallback.dtype == BF16
    torch.testing.assert_close(fallback.float(), ref, atol=BF16_ATOL, rtol=0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "page_size"), SHAPES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (40, 0.0), (0, 2.0)])
def test_extend_over_an_int8_pool_is_the_bfloat16_kernel_over_its_rounded_rows(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, window: int, softcap: float
) -> None:
    """With AVX512-BF16 the int8 build's extend runs the bfloat16 pool's item kernel over each
    row times its scale rounded once to bfloat16: bit for bit that kernel over a bfloat16 pool
    holding those rows."""
    if not extend_kernel_features(I8) & extend_kernel_features(BF16) & 2:
        pytest.skip("no AVX512-BF16 here: an int8 pool's extend takes the float32 item kernels")
    seq_lens = [50, 300, 17, 64, 129, 33, 193]
    q_lens = [50, 120, 1, 33, 16, 33, 35]
    kv = PagedInt8KV(seq_lens, page_size, num_kv_heads, head_dim, seed=head_dim + page_size)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    q = bf16_queries((int(cu[-1]), num_heads, head_dim), seed=3)
    scale = head_dim**-0.5
    k16, v16 = dequantize_kv(kv.k_cache, BF16), dequantize_kv(kv.v_cache, BF16)
    outs = []
    for k_cache, v_cache in ((kv.k_cache, kv.v_cache), (k16, v16)):
        plan = plan_native_extend(kv.block_table, cu, kv.seq_lens, page_size, num_heads, k_cache)
        assert plan is not None
        outs.append(native_extend_attention(q, k_cache, v_cache, plan, scale, window, softcap))
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1])


def test_the_decode_fallback_takes_bfloat16_queries_over_an_int8_pool() -> None:
    """The torch reference's gathered decode (where no kernel runs), padded chunks included."""
    kv = PagedInt8KV([1, 31, 70, 5, 129], 16, 3, 64, seed=7)
    q = bf16_queries((5, 9, 64), seed=4)
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125)
    got = decode_attention(q, *args)
    assert got.dtype == BF16
    torch.testing.assert_close(
        got.float(), decode_attention(q.float(), *args), atol=BF16_ATOL, rtol=0
    )


def test_a_float16_pool_still_refuses_bfloat16_queries() -> None:
    k_cache = torch.zeros(16, 1, 64, dtype=torch.float16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    plan = plan_native_decode(table, lens, 16, 2, k_cache)
    assert plan is not None
    with pytest.raises(ValueError, match="float16 KV pool is read with float32 queries"):
        native_decode_attention(torch.zeros(1, 2, 64, dtype=BF16), k_cache, k_cache, plan, 1.0)
