"""The Triton kernels over int8 and fp8 (e4m3) K/V pools, under the Triton interpreter (CPU), and
compiled for sm_90 without a GPU.

The store kernels against their torch twins bit for bit (values and scales:
kernels/reference/kv_int8_ref.py, kv_fp8_ref.py); the attention kernels against the torch
references over the same pool dequantized to float32, within 1e-4 (float32 queries: the
interpreter's dots are float32; the kernels take the scales on the dot products and softmax
weights instead, so only the order of the float32 rounding differs). Unwritten pool rows hold
0xFF bytes, whose scale is a bfloat16 NaN: a kernel that reads a key it should not see fails
loudly.
"""

from __future__ import annotations

import os

# Before triton loads (tests/conftest.py sets it too): run the kernels in the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import textwrap

import pytest
import torch

from asyncengine.kernels.reference import attention_ref, kv_fp8_ref, kv_int8_ref
from asyncengine.kernels.triton.triton_decode_attention import decode_attention
from asyncengine.kernels.triton.triton_extend_attention import extend_attention
from asyncengine.kernels.triton.triton_kv_store import store_kv
from asyncengine.kernels.triton.triton_rotary_store import rotary_store
from tests.kernels.test_triton_kernels import PagedKV
from tests.python_subprocess import run_python

I8, FP8 = torch.int8, kv_fp8_ref.FP8
POOLS = [I8, FP8]
QUANTIZE = {I8: kv_int8_ref.quantize_kv, FP8: kv_fp8_ref.quantize_kv_fp8}
ATOL = RTOL = 1e-4


def unwritten_pool(
    num_slots: int, num_kv_heads: int, head_dim: int, pool: torch.dtype
) -> torch.Tensor:
    """A pool layer whose every row reads as NaN (scale bytes 0xFFFF) until written."""
    shape = (num_slots, num_kv_heads, head_dim + kv_int8_ref.SCALE_BYTES)
    return torch.full(shape, -1, dtype=I8).view(pool)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def quantized_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pool: torch.dtype,
    gen: torch.Generator,
) -> PagedKV:
    """Requests' pages drawn shuffled from a quantized pool with spare pages; rows of several
    magnitudes (per-row scales that differ), one all-zero row (scale 0)."""
    pages_needed = [-(-length // page_size) for length in seq_lens]
    num_pages = sum(pages_needed) + 3
    order = torch.randperm(num_pages, generator=gen)
    block_table = torch.zeros((len(seq_lens), max(pages_needed)), dtype=torch.int32)
    k_cache = unwritten_pool(num_pages * page_size, num_kv_heads, head_dim, pool)
    v_cache = k_cache.clone()
    taken = 0
    for b, (length, count) in enumerate(zip(seq_lens, pages_needed, strict=True)):
        pages = order[taken : taken + count]
        taken += count
        block_table[b, :count] = pages.to(torch.int32)
        positions = torch.arange(length)
        slots = pages[positions // page_size] * page_size + positions % page_size
        for cache in (k_cache, v_cache):
            magnitude = torch.rand((length, num_kv_heads, 1), generator=gen) * 4 + 0.1
            rows = torch.randn((length, num_kv_heads, head_dim), generator=gen) * magnitude
            rows[0, 0] = 0.0
            cache.view(I8)[slots] = QUANTIZE[pool](rows).view(I8)
    return PagedKV(k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32))


def dequantized(kv: PagedKV) -> PagedKV:
    """The pool in float32 (unwritten rows NaN), for the torch references."""
    k, v = (kv_int8_ref.dequantize_kv(c) for c in (kv.k_cache, kv.v_cache))
    return PagedKV(k, v, kv.block_table, kv.seq_lens)


def hard_rows(num_rows: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of amax 448 (an fp8 scale of exactly 1, an int8 one of 448 / 127 rounded up) whose
    other values are e4m3's midpoints, its own values and random ones: ties to even, rounding
    that carries into the exponent, subnormals."""
    finite = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(FP8).float()
    finite = finite[finite.isfinite() & (finite >= 0)].unique()
    hard = torch.cat([(finite[1:] + finite[:-1]) / 2, finite, finite[:40] * 0.999])
    hard = hard * torch.where(torch.rand(hard.shape, generator=gen) < 0.5, -1.0, 1.0)
    pick = torch.randint(0, hard.numel(), (num_rows, head_dim), generator=gen)
    rows = hard[pick]
    rows[:, 0] = 448.0
    return rows


# --- stores: the reference's bits --------------------------------------------------------------


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 128), (2, 64)])
def test_store_kv_quantizes_as_the_reference(
    pool: torch.dtype, dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_tokens, num_slots = 9, 14
    # k and v as strided views of one fused projection output, as the model produces them.
    kv = torch.randn((num_tokens, 2 * num_kv_heads * head_dim + 3), generator=gen)
    kv = (kv * torch.rand((num_tokens, 1), generator=gen) * 8).to(dtype)
    kv[1] = 0.0  # zero rows: scale 0, values 0
    kv[2, :head_dim] = 0.5 * torch.arange(head_dim)  # exact halves: rounding to even shows
    k = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim : -3].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[4] = -1  # a padding token: stored nowhere
    k_cache = unwritten_pool(num_slots, num_kv_heads, head_dim, pool)
    v_cache = k_cache.clone()
    k_want, v_want = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    k_want.view(I8)[slots[keep]] = QUANTIZE[pool](k[keep]).view(I8)
    v_want.view(I8)[slots[keep]] = QUANTIZE[pool](v[keep]).view(I8)

    store_kv(k_cache, v_cache, k, v, slots)
    assert same_bits(k_cache, k_want)
    assert same_bits(v_cache, v_want)


@pytest.mark.parametrize("pool", POOLS)
def test_store_kv_rounds_ties_and_binade_edges_as_the_reference(pool: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_kv_heads, head_dim = 24, 2, 128
    k = hard_rows(num_tokens * num_kv_heads, head_dim, gen).view(num_tokens, num_kv_heads, -1)
    v = k.flip(-1) / 1024  # other scales: not exactly 1
    k_cache = unwritten_pool(num_tokens, num_kv_heads, head_dim, pool)
    v_cache = k_cache.clone()
    store_kv(k_cache, v_cache, k, v, torch.arange(num_tokens))
    assert same_bits(k_cache, QUANTIZE[pool](k))
    assert same_bits(v_cache, QUANTIZE[pool](v))


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(3, 1, 64), (8, 2, 128), (4, 4, 64)]
)
def test_rotary_store_quantizes_the_rows_it_would_store(
    pool: torch.dtype, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Into a quantized pool, the fused kernel stores the twin's quantization of the rows it
    stores into a pool of qkv's dtype (the rotated keys as rounded to that dtype), and rotates
    q the same."""
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    num_tokens, num_slots = 5, 16
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn((num_tokens, width), generator=gen) * 3).to(dtype)
    angles = torch.rand((100, head_dim // 2), generator=gen) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 100, (num_tokens,), generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[0] = -1

    float_k = torch.zeros((num_slots, num_kv_heads, head_dim), dtype=dtype)
    float_v = float_k.clone()
    q_float = rotary_store(
        qkv.clone(), num_heads, num_kv_heads, positions, cos_sin, float_k, float_v, slots
    )
    k_cache = unwritten_pool(num_slots, num_kv_heads, head_dim, pool)
    v_cache = k_cache.clone()
    q = rotary_store(qkv, num_heads, num_kv_heads, positions, cos_sin, k_cache, v_cache, slots)

    assert torch.equal(q, q_float)
    written = slots[slots >= 0]
    unwritten = torch.ones(num_slots, dtype=torch.bool)
    unwritten[written] = False
    for got, rows in ((k_cache, float_k), (v_cache, float_v)):
        assert same_bits(got[written], QUANTIZE[pool](rows[written]))
        assert got[unwritten].view(I8).eq(-1).all()


# --- attention: dequantized on load ------------------------------------------------------------


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize(
    ("head_dim", "group", "page_size", "num_splits"),
    [(64, 1, 16, None), (128, 4, 1, 3), (64, 8, 16, 2), (128, 8, 5, 1)],
)
def test_decode_attention_over_a_quantized_pool_matches_the_reference(
    pool: torch.dtype, head_dim: int, group: int, page_size: int, num_splits: int | None
) -> None:
    gen = torch.Generator().manual_seed(head_dim + group)
    seq_lens = [33, 1, 17, 70]  # not multiples of the page
    kv = quantized_paged_kv(seq_lens, 2, head_dim, page_size, pool, gen)
    q = torch.randn((len(seq_lens), 2 * group, head_dim), generator=gen)
    rest = (kv.block_table, kv.seq_lens, page_size, head_dim**-0.5)
    got = decode_attention(q, kv.k_cache, kv.v_cache, *rest, num_splits=num_splits)
    ref = dequantized(kv)
    want = attention_ref.decode_attention(q, ref.k_cache, ref.v_cache, *rest)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize(("head_dim", "group", "page_size"), [(64, 1, 16), (128, 4, 1), (64, 8, 7)])
def test_extend_attention_over_a_quantized_pool_matches_the_reference(
    pool: torch.dtype, head_dim: int, group: int, page_size: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim * group)
    lengths = [(5, 20), (0, 9), (16, 1)]  # (cached prefix, new tokens)
    q_lens = [new for _, new in lengths]
    kv = quantized_paged_kv([p + n for p, n in lengths], 2, head_dim, page_size, pool, gen)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn((sum(q_lens), 2 * group, head_dim), generator=gen)
    rest = (kv.block_table, cu_seqlens_q, kv.seq_lens, page_size, head_dim**-0.5)
    got = extend_attention(q, kv.k_cache, kv.v_cache, *rest)
    ref = dequantized(kv)
    want = attention_ref.extend_attention(q, ref.k_cache, ref.v_cache, *rest)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("pool", POOLS)
def test_quantized_attention_with_window_and_softcap_matches_the_reference(
    pool: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(8)
    options = {"window": 20, "softcap": 0.8}
    kv = quantized_paged_kv([1, 9, 40, 70], 2, 64, 16, pool, gen)
    ref = dequantized(kv)
    q = torch.randn((4, 6, 64), generator=gen) * 2
    rest = (kv.block_table, kv.seq_lens, 16, 0.125)
    want = attention_ref.decode_attention(q, ref.k_cache, ref.v_cache, *rest, **options)
    for splits in (1, 3):
        got = decode_attention(q, kv.k_cache, kv.v_cache, *rest, num_splits=splits, **options)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)

    q_lens = [3, 18, 40]
    kv = quantized_paged_kv([21, 18, 56], 2, 64, 16, pool, gen)
    ref = dequantized(kv)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn((sum(q_lens), 6, 64), generator=gen) * 2
    rest = (kv.block_table, cu, kv.seq_lens, 16, 0.125)
    want = attention_ref.extend_attention(q, ref.k_cache, ref.v_cache, *rest, **options)
    got = extend_attention(q, kv.k_cache, kv.v_cache, *rest, **options)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_attention_refuses_queries_that_do_not_fit_the_pool_rows() -> None:
    pool = unwritten_pool(16, 1, 64, I8)
    q = torch.zeros((1, 2, 66))  # the int8 row's width, not its head dim
    table = torch.zeros((1, 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q, pool, pool, table, torch.tensor([3], dtype=torch.int32), 16, 0.1)


# --- GPU code generation without a GPU ---------------------------------------------------------

_COMPILE_QUANTIZED_FOR_SM90 = textwrap.dedent(
    """
    import sys
    import warnings
    warnings.filterwarnings("ignore")
    import triton.language as tl

    from asyncengine.kernels.triton import triton_decode_attention, triton_extend_attention
    from asyncengine.kernels.triton import triton_kv_store, triton_rotary_store
    from tests.triton_sm90 import compile_for_sm90 as compile_any

    POOL = sys.argv[1]  # the pool's pointer type: *i8 or *fp8e4nv

    def compile_for_sm90(kernel, constants, num_warps=4, num_stages=2):
        pointers = {"k_cache_ptr": POOL, "v_cache_ptr": POOL}
        compile_any(kernel, constants, num_warps, num_stages, pointers)

    bf16 = tl.bfloat16
    compile_for_sm90(
        triton_decode_attention._decode_split_kernel,
        dict(GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, DOT_DTYPE=bf16, DIRECT=False,
             QUANTIZED=True, BLOCK_N=64),
        num_stages=3,
    )
    compile_for_sm90(
        triton_extend_attention._extend_kernel,
        dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, DOT_DTYPE=bf16, QUANTIZED=True,
             BLOCK_M=128, BLOCK_N=64),
        num_warps=8, num_stages=3,
    )
    compile_for_sm90(
        triton_kv_store._store_kv_quantized_kernel, dict(HEAD_DIM=128, BLOCK_D=128), 1
    )
    compile_for_sm90(
        triton_rotary_store._rotary_store_kernel,
        dict(HEAD_DIM=64, HALF=32, BLOCK_HQ=16, BLOCK_HK=4, BLOCK_HALF=32, QUANTIZED=True),
    )
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["*i8", "*fp8e4nv"])
def test_the_quantized_kernels_compile_for_sm90(pool: str) -> None:
    """Triton's own compiler and ptxas (shipped in the wheel) build the int8 and fp8 variants."""
    stdout = run_python(_COMPILE_QUANTIZED_FOR_SM90, pool, timeout=300)
    assert stdout.count("compiled") == 4, stdout
