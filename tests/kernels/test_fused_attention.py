"""The fused decode step's attention (kernels/cpu/cpu_group_attention.h, run alone through
``decode_step_native.group_attention``) against the torch reference: ragged lengths across
the 32-key blocks and page boundaries, GQA ratios (a group larger than an item's 8 heads is
split), head dims that take each register chunk (64, 32, 16, 8 floats) or the portable loop,
one thread and several (one request: an item per query head; a few: an item per kv head; many
requests: an item per row); sliding windows and Gemma 2's soft-capped scores over every pool the
step reads, built for this CPU and for AVX2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncengine.kernels.cpu import cpu_native, decode_step_native
from asyncengine.kernels.reference.attention_ref import decode_attention
from tests.kernels.test_kernels_ref import TOLERANCE, PagedKV, naive_attention
from tests.kernels.test_kv_int8_kernels import PagedInt8KV, atol_as_read, query_as_read
from tests.native_support import needs_native

pytestmark = needs_native


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [
        (9, 3, 64, 16),  # SmolLM2-135M
        (4, 4, 32, 1),
        (8, 2, 128, 16),
        (16, 1, 64, 7),  # a group of 16: two items of 8 heads
        (12, 1, 120, 5),  # chunks of 64 + 32 + 16 + 8 floats; a group of 12: 6 + 6
        (4, 2, 16, 4),
        (6, 2, 20, 3),  # not a multiple of 8: the portable loops
        (40, 8, 32, 16),  # rows as items: 4 kv heads (20 query heads) an item
    ],
)
@pytest.mark.parametrize(
    "seq_lens",
    [
        [1, 31, 32, 33, 70, 5, 129, 64],
        [97],
        [40, 3, 65, 17, 250, 1, 96, 33, 12, 64, 31, 8, 77],
        [1500],  # split-K: one row's keys in ranges, merged
        [700, 2051],  # split-K over rows of different lengths (a range may be short)
    ],
    ids=["8", "1", "13", "1-long", "2-long"],
)
def test_group_attention_matches_the_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    threads: int,
) -> None:
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, torch.float32, seed=head_dim)
    gen = torch.Generator().manual_seed(page_size)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale)
    got = decode_step_native.group_attention(q, *args)
    ref = decode_attention(q, *args)
    assert torch.isfinite(got).all(), "read a slot no request owns"
    torch.testing.assert_close(got, ref, atol=TOLERANCE[torch.float32], rtol=0)
    for b in range(len(seq_lens)):
        want = naive_attention(q[b : b + 1], kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(got[b], want[0], atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("seq_lens", [[50, 3, 200], [1200]], ids=["3", "split-K"])
def test_large_scores_do_not_overflow(seq_lens: list[int]) -> None:
    """The online softmax subtracts the running max: scores near 1e4 stay finite, and a later
    block (or range, merged) with a larger max rescales what came before."""
    kv = PagedKV(seq_lens, 16, 1, 64, torch.float32, seed=0)
    kv.k_cache.mul_(100.0)
    q = torch.full((len(seq_lens), 1, 64), 3.0)
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 1.0)
    got = decode_step_native.group_attention(q, *args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, decode_attention(q, *args), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("seq_lens", "window"),
    [
        ([1, 31, 33, 70, 5, 129], 8),  # rows shorter and longer than the window
        ([1500], 40),  # split-K: the window's keys in ranges, some of them empty
        ([700, 2051], 600),  # split-K over a window that spans several ranges
    ],
    ids=["6", "1-long", "2-long"],
)
def test_a_sliding_window_sees_the_last_keys_only(
    seq_lens: list[int], window: int, threads: int
) -> None:
    """A sliding layer's rows attend to their last ``window`` keys (Gemma 3), as the torch
    reference's windowed decode; the keys before it hold NaN, so one read poisons the row."""
    kv = PagedKV(seq_lens, 16, 2, 64, torch.float32, seed=window)
    gen = torch.Generator().manual_seed(window)
    q = torch.randn(len(seq_lens), 4, 64, generator=gen)
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125)
    want = decode_attention(q, *args, window=window)
    for b, length in enumerate(seq_lens):  # the keys no window reaches: unread
        for p in range(max(0, length - window)):
            slot = int(kv.block_table[b, p // 16]) * 16 + p % 16
            kv.k_cache[slot] = float("nan")
            kv.v_cache[slot] = float("nan")
    got = decode_step_native.group_attention(q, *args, window=window)
    assert torch.isfinite(got).all(), "read a key outside the window"
    torch.testing.assert_close(got, want, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.fixture(params=["native", "avx2"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The step's library of each pool built for this CPU, or forced to AVX2 (-mno-avx512f: the
    8-lane loops where this CPU streams blocks of 16 keys, or takes Q.K in integers)."""
    if request.param == "avx2":
        for dtype, flags in decode_step_native.KV_BUILD_FLAGS.items():
            monkeypatch.setitem(decode_step_native.KV_BUILD_FLAGS, dtype, (*flags, "-mno-avx512f"))
        # the int8 build that query_as_read asks whether the query is rounded
        monkeypatch.setattr(
            cpu_native, "_KV_I8_FLAGS", decode_step_native.KV_BUILD_FLAGS[torch.int8]
        )
    decode_step_native._library.cache_clear()
    yield request.param
    decode_step_native._library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("head_dim", [64, 48])  # 64: an int8 pool's integer Q.K on VNNI
@pytest.mark.parametrize(
    ("seq_lens", "window"),
    [
        ([1, 31, 33, 70, 5, 129], 0),  # an item per row or kv head, ragged blocks
        ([1500], 0),  # split-K: each range's scores capped before its softmax state
        ([700, 2051], 600),  # split-K over a sliding window (Gemma 2's sliding layers)
    ],
    ids=["6", "1-long", "2-long-window"],
)
def test_soft_capped_scores_follow_the_reference(
    dtype: torch.dtype,
    head_dim: int,
    seq_lens: list[int],
    window: int,
    isa: str,
    threads: int,
) -> None:
    """Gemma 2's attention soft-cap: each scaled score s is softcap * tanh(s / softcap) before
    the softmax, as the torch reference's decode. The scores here reach several times the cap,
    so that uncapped attention lands far outside the tolerance."""
    softcap = 1.5
    kv: PagedKV | PagedInt8KV
    if dtype == torch.int8:
        kv = PagedInt8KV(seq_lens, 16, 2, head_dim, seed=head_dim)
    else:
        kv = PagedKV(seq_lens, 16, 2, head_dim, dtype, seed=head_dim)
    q = 3.0 * torch.randn(len(seq_lens), 6, head_dim, generator=torch.Generator().manual_seed(5))
    scale = head_dim**-0.5
    rest = (kv.block_table, kv.seq_lens, 16, scale, window)
    got = decode_step_native.group_attention(q, kv.k_cache, kv.v_cache, *rest, softcap=softcap)
    # the reference over the values the pool holds, in float32 (the kernel's arithmetic)
    q_read, atol = q, TOLERANCE[torch.float32]
    pool = (kv.k_cache.float(), kv.v_cache.float())
    if dtype == torch.int8:
        q_read, atol, pool = query_as_read(q), atol_as_read(head_dim), (kv.k_cache, kv.v_cache)
    want = decode_attention(q_read, *pool, *rest, softcap=softcap)
    assert torch.isfinite(got).all(), "read a slot no request owns"
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    uncapped = decode_attention(q_read, *pool, *rest)
    assert (uncapped - want).abs().max() > 100 * atol  # the cap changes the output
