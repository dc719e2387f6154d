"""Every Triton kernel against its torch reference, under the Triton interpreter (CPU).

Shapes are drawn by hypothesis and kept tiny (the interpreter runs each program in numpy).
Unused pool slots hold NaN, so a kernel that reads a key it should not see fails loudly.
A last test compiles every kernel for an H100 (sm_90) without a GPU, so GPU-only compile
errors surface here too.
"""

from __future__ import annotations

import os

# Before triton loads (tests/conftest.py sets it too): run the kernels in the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import textwrap
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncengine.kernels.reference import (
    activation_ref,
    attention_ref,
    kv_store_ref,
    norm_ref,
    rotary_ref,
)
from asyncengine.kernels.triton.triton_activation import silu_and_mul
from asyncengine.kernels.triton.triton_decode_attention import choose_num_splits, decode_attention
from asyncengine.kernels.triton.triton_extend_attention import extend_attention
from asyncengine.kernels.triton.triton_kv_store import store_kv
from asyncengine.kernels.triton.triton_norm import fused_add_rms_norm, rms_norm
from asyncengine.kernels.triton.triton_rotary import apply_rotary
from tests.python_subprocess import run_python

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}
dtypes = st.sampled_from(DTYPES)
head_dims = st.sampled_from([64, 128])
page_sizes = st.sampled_from([1, 16])
gqa_ratios = st.sampled_from([1, 3, 7])


@dataclass(slots=True)
class PagedKV:
    k_cache: torch.Tensor  # [S, Hkv, D], NaN outside the requests' tokens
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, P] int32
    seq_lens: torch.Tensor  # [B] int32


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> PagedKV:
    """Requests' pages drawn shuffled from a pool with spare pages; only real tokens are finite."""
    pages_needed = [-(-length // page_size) for length in seq_lens]
    num_pages = sum(pages_needed) + 3
    order = torch.randperm(num_pages, generator=generator)
    width = max(max(pages_needed), 1)
    block_table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    taken = 0
    for b, (length, count) in enumerate(zip(seq_lens, pages_needed, strict=True)):
        pages = order[taken : taken + count]
        taken += count
        block_table[b, :count] = pages.to(torch.int32)
        positions = torch.arange(length)
        slots = pages[positions // page_size] * page_size + positions % page_size
        k_cache[slots] = torch.randn((length, num_kv_heads, head_dim), generator=generator).to(
            dtype
        )
        v_cache[slots] = torch.randn((length, num_kv_heads, head_dim), generator=generator).to(
            dtype
        )
    return PagedKV(k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32))


def randn(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype)


def upcast(args: tuple[object, ...]) -> tuple[object, ...]:
    """Floating tensors to float32: the attention oracle runs in higher precision than fp16."""
    return tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])


# --- attention ---------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    page_size=page_sizes,
    group=gqa_ratios,
    num_kv_heads=st.integers(1, 2),
    head_dim=head_dims,
    dtype=dtypes,
    num_splits=st.sampled_from([None, 1, 2, 5]),
    seed=st.integers(0, 2**16),
)
@example(
    seq_lens=[33, 1, 16], page_size=16, group=7, num_kv_heads=1, head_dim=128,
    dtype=torch.float16, num_splits=3, seed=1,
)  # fmt: skip
@example(
    seq_lens=[17, 40], page_size=1, group=3, num_kv_heads=2, head_dim=64,
    dtype=torch.float32, num_splits=None, seed=2,
)  # fmt: skip
def test_decode_attention_matches_reference(
    seq_lens: list[int],
    page_size: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int | None,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, page_size, dtype, gen)
    q = randn((len(seq_lens), num_kv_heads * group, head_dim), dtype, gen)
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale)
    got = decode_attention(*args, num_splits=num_splits)
    assert_close(got, attention_ref.decode_attention(*upcast(args)).to(dtype), dtype)


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 24)), min_size=1, max_size=3
    ),  # (cached prefix, new tokens) per request
    page_size=page_sizes,
    group=gqa_ratios,
    num_kv_heads=st.integers(1, 2),
    head_dim=head_dims,
    dtype=dtypes,
    pass_max_q_len=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(
    lengths=[(21, 3), (0, 18), (16, 1)], page_size=16, group=7, num_kv_heads=1, head_dim=128,
    dtype=torch.float16, pass_max_q_len=True, seed=3,
)  # fmt: skip
@example(
    lengths=[(5, 20), (37, 2)], page_size=1, group=3, num_kv_heads=2, head_dim=64,
    dtype=torch.float32, pass_max_q_len=False, seed=4,
)  # fmt: skip
def test_extend_attention_matches_reference(
    lengths: list[tuple[int, int]],
    page_size: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    pass_max_q_len: bool,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    q_lens = [new for _, new in lengths]
    kv = make_paged_kv([p + n for p, n in lengths], num_kv_heads, head_dim, page_size, dtype, gen)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = randn((sum(q_lens), num_kv_heads * group, head_dim), dtype, gen)
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_table, cu_seqlens_q, kv.seq_lens, page_size, scale)
    got = extend_attention(*args, max_q_len=max(q_lens) if pass_max_q_len else None)
    assert_close(got, attention_ref.extend_attention(*upcast(args)).to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (0, 1.5), (20, 0.8)])
def test_attention_with_window_and_softcap_matches_reference(
    dtype: torch.dtype, window: int, softcap: float
) -> None:
    """Sliding window (decode and extend, splits too) and soft-capping against the references;
    windows shorter and longer than a key block, prefixes that start mid-window."""
    gen = torch.Generator().manual_seed(window + 7)
    options = {"window": window, "softcap": softcap}
    kv = make_paged_kv([1, 9, 40, 70], 2, 64, 16, dtype, gen)
    q = randn((4, 6, 64), dtype, gen) * 2
    args = (q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125)
    want = attention_ref.decode_attention(*upcast(args), **options).to(dtype)
    for splits in (1, 3):
        assert_close(decode_attention(*args, num_splits=splits, **options), want, dtype)

    q_lens = [3, 18, 40, 1]
    kv = make_paged_kv([21, 18, 56, 9], 2, 64, 16, dtype, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = randn((sum(q_lens), 6, 64), dtype, gen) * 2
    args = (q, kv.k_cache, kv.v_cache, kv.block_table, cu, kv.seq_lens, 16, 0.125)
    want = attention_ref.extend_attention(*upcast(args), **options).to(dtype)
    plain = attention_ref.extend_attention(*upcast(args)).to(dtype)
    assert not torch.allclose(want, plain, **TOLERANCE[dtype]), "the options must matter here"
    assert_close(extend_attention(*args, **options), want, dtype)


def test_decode_attention_writes_into_out_and_zeroes_empty_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    kv = make_paged_kv([9, 30], 2, 64, 16, torch.float32, gen)
    kv.seq_lens[0] = 0  # a padding row (as in a padded CUDA-graph batch)
    q = randn((2, 4, 64), torch.float32, gen)
    out = torch.full_like(q, 7.0)
    for splits in (1, 3):
        got = decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125,
            num_splits=splits, out=out,
        )  # fmt: skip
        assert got is out
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        want = attention_ref.decode_attention(
            q[1:], kv.k_cache, kv.v_cache, kv.block_table[1:], kv.seq_lens[1:], 16, 0.125
        )
        assert_close(out[1:], want, torch.float32)


def test_num_splits_covers_a_small_batch_and_stays_one_for_a_large_one() -> None:
    cpu = torch.device("cpu")
    assert choose_num_splits(64, 8, 4096, cpu) == 1
    assert choose_num_splits(1, 1, 4096, cpu) > 1
    assert choose_num_splits(1, 1, 100, cpu) == 1  # too short to be worth splitting


# --- KV store ----------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(
    num_tokens=st.integers(1, 12),
    num_kv_heads=st.integers(1, 3),
    head_dim=head_dims,
    dtype=dtypes,
    seed=st.integers(0, 2**16),
)
def test_store_kv_matches_reference(
    num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_tokens + 5
    # k and v as strided views of one fused projection output, as the model produces them.
    kv = randn((num_tokens, 2 * num_kv_heads * head_dim + 3), dtype, gen)
    k = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim : -3].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    caches = [randn((num_slots, num_kv_heads, head_dim), dtype, gen) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv(caches[0], caches[1], k, v, slots)
    kv_store_ref.store_kv(expected[0], expected[1], k, v, slots)
    assert torch.equal(caches[0], expected[0])
    assert torch.equal(caches[1], expected[1])


def test_store_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros((4, 1, 64))
    v_cache = torch.zeros((4, 1, 64))
    k = torch.ones((2, 1, 64))
    store_kv(k_cache, v_cache, k, 2 * k, torch.tensor([-1, 2]))
    assert k_cache[2].eq(1).all() and v_cache[2].eq(2).all()
    assert k_cache[[0, 1, 3]].eq(0).all() and v_cache[[0, 1, 3]].eq(0).all()


# --- norms, rotary, activation -----------------------------------------------------------------

hidden_sizes = st.sampled_from([64, 96, 100, 576])


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 6),
    hidden=hidden_sizes,
    dtype=dtypes,
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_reference(
    rows: int, hidden: int, dtype: torch.dtype, eps: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn((rows, 2, hidden), dtype, gen) * 3
    weight = randn((hidden,), dtype, gen)
    assert_close(rms_norm(x, weight, eps), norm_ref.rms_norm(x, weight, eps), dtype)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 6), hidden=hidden_sizes, dtype=dtypes, seed=st.integers(0, 2**16))
def test_fused_add_rms_norm_matches_reference(
    rows: int, hidden: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn((rows, hidden), dtype, gen)
    residual = randn((rows, hidden), dtype, gen) * 4
    weight = randn((hidden,), dtype, gen)
    x_before, residual_before = x.clone(), residual.clone()
    y, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    y_ref, summed_ref = norm_ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, summed_ref)
    assert_close(y, y_ref, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@settings(max_examples=10, deadline=None)
@given(
    num_tokens=st.integers(1, 8),
    num_kv_heads=st.integers(1, 3),
    group=gqa_ratios,
    head_dim=head_dims,
    dtype=dtypes,
    seed=st.integers(0, 2**16),
)
def test_apply_rotary_matches_reference_in_place_on_strided_views(
    num_tokens: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn((num_tokens, q_size + 2 * kv_size), dtype, gen)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    max_pos = 300
    angles = torch.rand((max_pos, head_dim // 2), generator=gen) * 6.3
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    q_ref, k_ref = rotary_ref.apply_rotary(q.clone(), k.clone(), positions, cos_sin_cache)
    v_before = qkv[:, q_size + kv_size :].clone()

    q_out, k_out = apply_rotary(q, k, positions, cos_sin_cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 6),
    intermediate=st.sampled_from([16, 96, 200, 1100]),
    dtype=dtypes,
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul_matches_reference(
    rows: int, intermediate: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn((rows, 2 * intermediate), dtype, gen) * 3
    assert_close(silu_and_mul(x), activation_ref.silu_and_mul(x), dtype)


def test_kernels_refuse_cpu_tensors_outside_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need CUDA tensors"):
        silu_and_mul(torch.zeros((2, 8)))


# --- GPU code generation without a GPU ---------------------------------------------------------

_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    import triton.language as tl

    from asyncengine.kernels.triton import triton_activation, triton_decode_attention
    from asyncengine.kernels.triton import triton_extend_attention, triton_kv_store, triton_norm
    from asyncengine.kernels.triton import triton_rotary
    from tests.triton_sm90 import compile_for_sm90

    bf16 = tl.bfloat16
    compile_for_sm90(
        triton_decode_attention._decode_split_kernel,
        dict(GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, DOT_DTYPE=bf16, DIRECT=False,
             QUANTIZED=False, BLOCK_N=64),
        num_stages=3,
    )
    compile_for_sm90(
        triton_decode_attention._decode_merge_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=4)
    )
    compile_for_sm90(
        triton_extend_attention._extend_kernel,
        dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, DOT_DTYPE=bf16, QUANTIZED=False,
             BLOCK_M=128, BLOCK_N=64),
        num_warps=8, num_stages=3,
    )
    compile_for_sm90(
        triton_kv_store._store_kv_kernel, dict(HEAD_DIM=128, NUM_ELEMENTS=1024, BLOCK=1024)
    )
    compile_for_sm90(triton_norm._rms_norm_kernel, dict(ADD_RESIDUAL=True, BLOCK=4096), 8)
    compile_for_sm90(
        triton_rotary._rotary_kernel, dict(HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64)
    )
    compile_for_sm90(triton_activation._silu_and_mul_kernel, dict(BLOCK=1024))
    """
)


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90() -> None:
    """Triton's own compiler and ptxas (shipped in the wheel) build the kernels for an H100."""
    fusion = os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")
    stdout = run_python(_COMPILE_FOR_SM90, env={"TRITON_DEFAULT_FP_FUSION": fusion}, timeout=300)
    assert stdout.count("compiled") == 7, stdout
