"""The fused step's attention (kernels/cpu/cpu_group_attention.h; on AVX-512 its streamed blocks,
cpu_stream_attention.h) over float32 and bfloat16 pools, built for this CPU's widest ISA and
forced to AVX2 (-mno-avx512f), against float32 attention over the pool's values: odd head dims
(16, 48: the loop that is not unrolled), groups of 1 to 8 query heads, one key, a ragged last
block, and long rows that split-K cuts into ranges of whole slots."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncengine.kernels.cpu import decode_step_native
from tests.kernels.test_kernels_ref import TOLERANCE, PagedKV, naive_attention
from tests.native_support import needs_native

pytestmark = needs_native
F32, BF16 = torch.float32, torch.bfloat16
ISAS = {"native": (), "avx2": ("-mno-avx512f",)}


@pytest.fixture(params=list(ISAS))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The step's library built for that ISA (its flags for each pool swapped in)."""
    for dtype in (F32, BF16):
        flags = decode_step_native.KV_BUILD_FLAGS[dtype] + ISAS[request.param]
        monkeypatch.setitem(decode_step_native.KV_BUILD_FLAGS, dtype, flags)
    decode_step_native._library.cache_clear()
    yield request.param
    decode_step_native._library.cache_clear()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [
        (9, 3, 64, 16),  # SmolLM2-135M: 3 query heads a kv head
        (32, 8, 128, 16),  # 4 a kv head, head dim 128
        (16, 2, 48, 5),  # 8 a kv head, head dim 48 (not unrolled)
        (5, 5, 16, 3),  # 1 a kv head, head dim 16
        (14, 2, 32, 7),  # 7 a kv head
    ],
)
@pytest.mark.parametrize("seq_lens", [[1], [17, 1], [1100], [513, 1030], [3, 600, 45]], ids=str)
def test_streamed_attention_matches_float32(
    isa: str,
    threads: int,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
) -> None:
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, dtype, seed=head_dim + page_size)
    gen = torch.Generator().manual_seed(len(seq_lens))
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    got = decode_step_native.group_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale
    )
    assert torch.isfinite(got).all(), "read a slot no request owns"
    for b in range(len(seq_lens)):  # float32 over the values the pool holds
        want = naive_attention(q[b : b + 1], kv.keys[b].float(), kv.values[b].float(), scale)
        torch.testing.assert_close(got[b], want[0], atol=TOLERANCE[F32], rtol=0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_a_range_whose_max_grows_late_rescales_what_came_before(
    isa: str, threads: int, dtype: torch.dtype
) -> None:
    """Scores that grow along the row (the running max rises in every block, and a later range
    of split-K holds the largest): the rescaled sums stay exact and finite."""
    kv = PagedKV([1500], 16, 3, 64, dtype, seed=1)
    ramp = torch.linspace(0.0, 5.0, 1500).view(1500, 1, 1).expand(1500, 3, 64)
    _write_keys(kv, ramp.to(dtype))
    q = torch.ones(1, 9, 64) / 8.0
    got = decode_step_native.group_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 1.0
    )
    want = naive_attention(q, kv.keys[0].float(), kv.values[0].float(), 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)


def _write_keys(kv: PagedKV, keys: torch.Tensor) -> None:
    """keys [len, kv_heads, head_dim] in place of request 0's keys, in the pool and in kv.keys"""
    n = keys.shape[0]
    pos = torch.arange(n)
    slots = kv.block_table[0, pos // kv.page_size].long() * kv.page_size + pos % kv.page_size
    kv.k_cache[slots] = keys
    kv.keys[0] = keys
