"""The int8 decode attention's integer Q.K (AVX-512 VNNI builds: kernels/cpu/cpu_stream_i8_dots.h)
on odd shapes: every group size it unrolls and the head dims it does not (192, 256), context
lengths around its 16-key blocks, 32-key prefetch blocks and split-K's 256-key ranges, 1 to 3
threads; both the fused step's attention and the paged decode kernel.

Oracles: the torch reference over the same int8 pool with the query rounded as the kernel
rounds it (kv_int8_ref.quantize_query: the float32 tolerance holds, and where the values are
summed in integers too test_kv_int8_kernels.I8_VALUES_ATOL), and the same
reference with the float32 query (the query's rounding alone moves the output by at most
QUERY_ATOL here: unit-variance rows). Where this CPU has no AVX-512 VNNI the kernels take the
float32 query and the first oracle is the plain reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine.kernels.cpu import cpu_native, decode_step_native
from asyncengine.kernels.cpu.attention_native import native_decode_attention, plan_native_decode
from asyncengine.kernels.cpu.plan_threads import planning_for
from asyncengine.kernels.reference.attention_ref import decode_attention
from asyncengine.kernels.reference.kv_int8_ref import dequantize_kv, quantize_kv, quantize_query
from tests.kernels.test_kernels_ref import TOLERANCE
from tests.kernels.test_kv_int8_kernels import PagedInt8KV, atol_as_read, query_as_read
from tests.native_support import needs_native

pytestmark = needs_native
ATOL = TOLERANCE[torch.float32]
# the output's largest move from rounding the query to int8 (unit-variance K/V rows; the
# same bound as rounding K/V to int8: test_kv_int8_kernels.INT8_ATOL)
QUERY_ATOL = 0.05
# (heads, kv heads, head dim, page size): groups 1..8, the unrolled dims 64 / 128 and the
# looped 192 / 256
SHAPES = [
    (9, 3, 64, 16),
    (12, 2, 128, 5),
    (5, 1, 64, 16),
    (14, 2, 64, 5),
    (7, 1, 128, 16),
    (6, 3, 128, 3),
    (4, 2, 192, 16),
    (8, 1, 256, 7),
    (3, 3, 256, 16),
]
# around 16-key blocks, 32-key prefetch blocks and 256-key split-K ranges; nine requests: the
# paged kernel's whole-request items on 1 and 2 threads (4 a thread), its per-kv-head ones on 3
SEQ_LENS = [
    [1, 15, 16, 17, 31, 33],
    [255],
    [257, 3],
    [513],
    [1031],
    [1, 15, 16, 17, 31, 33, 64, 100, 257],
]


def check(got: torch.Tensor, q: torch.Tensor, kv: PagedInt8KV, page_size: int) -> None:
    scale = q.shape[-1] ** -0.5
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale)
    assert torch.isfinite(got).all(), "read a slot no request owns"
    want = decode_attention(query_as_read(q), *args)
    torch.testing.assert_close(got, want, atol=atol_as_read(q.shape[-1]), rtol=0)
    torch.testing.assert_close(got, decode_attention(q, *args), atol=QUERY_ATOL, rtol=0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "page_size"), SHAPES)
@pytest.mark.parametrize("seq_lens", SEQ_LENS)
def test_fused_step_int8_query_dots(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    threads: int,
) -> None:
    kv = PagedInt8KV(seq_lens, page_size, num_kv_heads, head_dim, seed=num_heads + head_dim)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(7))
    scale = head_dim**-0.5
    got = decode_step_native.group_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale
    )
    check(got, q, kv, page_size)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "page_size"), SHAPES)
@pytest.mark.parametrize("seq_lens", SEQ_LENS)
def test_paged_decode_int8_query_dots(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    threads: int,
) -> None:
    kv = PagedInt8KV(seq_lens, page_size, num_kv_heads, head_dim, seed=num_heads + head_dim)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(8))
    plan = plan_native_decode(kv.block_table, kv.seq_lens, page_size, num_heads, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, head_dim**-0.5)
    check(got, q, kv, page_size)


def test_zero_and_outlier_queries() -> None:
    """A head of zeros (scale 0: every key weighs the same) and a head with one large element
    beside small ones (its scale set by the outlier) match the reference as the kernel reads
    them."""
    kv = PagedInt8KV([300], 16, 2, 64, seed=3)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(9))
    q[0, 0] = 0.0
    q[0, 2, 5] = 40.0
    got = decode_step_native.group_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125
    )
    ref = decode_attention(
        query_as_read(q), kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125
    )
    torch.testing.assert_close(got, ref, atol=atol_as_read(64), rtol=0)
    values = dequantize_kv(quantize_kv(kv.values[0][:, 0]))  # kv head 0's, as stored
    torch.testing.assert_close(got[0, 0], values.mean(dim=0), atol=atol_as_read(64), rtol=0)


def test_quantize_query_rounds_half_even_at_amax_over_127() -> None:
    q = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0, 0.49]])
    assert torch.equal(quantize_query(q), torch.tensor([[127.0, 0.0, 2.0, -2.0, -127.0, 0.0]]))
    assert torch.equal(quantize_query(torch.zeros(2, 8)), torch.zeros(2, 8))


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags there")
def test_avx512_vnni_builds_take_the_integer_dots() -> None:
    """Where the CPU has AVX-512 VNNI the int8 build says it rounds the query (so the first
    oracle above is the quantized one), for head dims that are a multiple of 64 only."""
    vnni = "avx512_vnni" in Path("/proc/cpuinfo").read_text(encoding="utf-8").split()
    assert cpu_native.kv_i8_query_dots(64) == vnni
    assert cpu_native.kv_i8_query_dots(128) == vnni
    assert not cpu_native.kv_i8_query_dots(96)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(12, 2, 128), (32, 8, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_request_items_match_kv_head_items(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Nine requests planned for one thread (4 requests a thread or more: an item takes a whole
    request, all its kv heads) and for three (an item per request and kv head, no split-K at
    18 or more items) give the same bits: the same keys in the same blocks per head."""
    lens = [1, 15, 16, 17, 31, 33, 64, 100, 257]
    kv = PagedInt8KV(lens, 16, num_kv_heads, head_dim, seed=head_dim)
    q = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    q = q.to(dtype)
    outs = []
    for plan_for in (1, 3):
        with planning_for(plan_for):
            plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, num_heads, kv.k_cache)
            assert plan is not None
            outs.append(native_decode_attention(q, kv.k_cache, kv.v_cache, plan, head_dim**-0.5))
    assert torch.equal(outs[0], outs[1])
    if dtype == torch.float32:  # and right (the bfloat16 queries' oracle: test_kv_int8_bf16.py)
        check(outs[0], q, kv, 16)
