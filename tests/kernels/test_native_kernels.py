"""The native CPU kernels (kernels/cpu/*.c, compiled on first use) against their torch references."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.attention_native import native_decode_attention, plan_native_decode
from asyncengine.kernels.reference.attention_ref import decode_attention
from tests.kernels.test_kernels_ref import TOLERANCE, PagedKV, naive_attention


def test_the_kernel_compiles_here() -> None:
    """The CI machines have a C compiler: the native path must be what runs there."""
    for name in ("cpu_decode_attention", "cpu_extend_attention", "cpu_layer_ops"):
        assert cpu_native.load(name) is not None, name
        assert cpu_native.library_path(name).is_file(), name


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The decode kernel gives whole requests to threads when there are >= 4 per thread (8
    requests on 1 thread) and one kv head per item otherwise (on 3): both paths are checked."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [(9, 3, 64, 16), (4, 4, 32, 1), (8, 2, 128, 16), (16, 1, 64, 7)],
)
@pytest.mark.parametrize(
    "seq_lens",
    [
        # ragged lengths across block boundaries (the kernel takes keys 16 at a time), length 1
        [1, 31, 32, 33, 70, 5, 129, 64],
        [1500],  # split-K: one request's keys in ranges, merged
        [700, 2051],
    ],
    ids=["8", "1-long", "2-long"],
)
def test_native_decode_matches_the_reference(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    threads: int,
) -> None:
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, dtype, seed=head_dim + page_size)
    gen = torch.Generator().manual_seed(1)
    # q as the model hands it over: a slice of a wider row (heads contiguous, rows strided)
    wide = torch.randn(len(seq_lens), num_heads + 3, head_dim, generator=gen).to(dtype)
    q = wide[:, :num_heads]
    scale = head_dim**-0.5
    plan = plan_native_decode(kv.block_table, kv.seq_lens, page_size, num_heads, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, scale)
    ref = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale)
    assert got.dtype == dtype and got.shape == (len(seq_lens), num_heads, head_dim)
    assert torch.isfinite(got.float()).all(), "read a slot no request owns"
    torch.testing.assert_close(got.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)
    for b in range(len(seq_lens)):  # and each request against the naive fp32 attention
        want = naive_attention(q[b : b + 1].float(), kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(got[b].float(), want[0], atol=TOLERANCE[dtype], rtol=0)


def test_large_scores_do_not_overflow() -> None:
    """The online softmax subtracts the running max: scores near 1e4 stay finite."""
    kv = PagedKV([50, 3], 16, 1, 64, torch.float32, seed=0)
    kv.k_cache.mul_(100.0)
    q = torch.full((2, 1, 64), 3.0)
    plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, 1, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, 1.0)
    ref = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_unsupported_shapes_and_dtypes_keep_the_torch_path() -> None:
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    odd_dim = torch.zeros(16, 1, 48)  # head_dim not a multiple of 32
    assert plan_native_decode(table, lens, 16, 1, odd_dim) is None
    double = torch.zeros(
        16, 1, 64, dtype=torch.float64
    )  # (float16: tests/kernels/test_kv_f16_kernels.py)
    assert plan_native_decode(table, lens, 16, 1, double) is None
    uneven = torch.zeros(16, 3, 64)  # 4 query heads over 3 kv heads
    assert plan_native_decode(table, lens, 16, 4, uneven) is None


def test_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_native.ENABLE_ENV, "0")
    cpu_native.load.cache_clear()
    try:
        table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        assert plan_native_decode(table, lens, 16, 1, torch.zeros(16, 1, 64)) is None
    finally:
        monkeypatch.delenv(cpu_native.ENABLE_ENV)
        cpu_native.load.cache_clear()


def test_thread_count_does_not_change_the_result() -> None:
    kv = PagedKV([40, 90, 7, 200], 16, 2, 64, torch.bfloat16, seed=3)
    q = torch.randn(4, 6, 64).to(torch.bfloat16)
    plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, 6, kv.k_cache)
    assert plan is not None
    previous = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(native_decode_attention(q, kv.k_cache, kv.v_cache, plan, 0.125))
    finally:
        torch.set_num_threads(previous)
    assert np.array_equal(outs[0].float().numpy(), outs[1].float().numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_ops_match_the_references(dtype: torch.dtype) -> None:
    """bf16: bit for bit (the same roundings after the same operations); fp32: up to the order
    of the RMS sum and the exp inside SiLU."""
    from asyncengine.kernels.cpu import layer_ops_native as native
    from asyncengine.kernels.reference import activation_ref, kv_store_ref, norm_ref, rotary_ref

    exact = dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    x, r, w = randn(37, 576), randn(37, 576), randn(576) + 1
    same(native.rms_norm(x, w, 1e-5), norm_ref.rms_norm(x, w, 1e-5))
    y, summed = native.fused_add_rms_norm(x, r.clone(), w, 1e-5)
    want_y, want_sum = norm_ref.fused_add_rms_norm(x, r, w, 1e-5)
    same(y, want_y)
    assert torch.equal(summed, want_sum)
    gate_up = randn(37, 2 * 1536, scale=4.0)
    same(native.silu_and_mul(gate_up), activation_ref.silu_and_mul(gate_up))

    heads, kv_heads, dim, slots = 9, 3, 64, 120
    qkv = randn(37, (heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, 2048, (37,), generator=gen)
    cos_sin = torch.randn(2048, dim, generator=gen)
    slot_mapping = torch.randperm(slots, generator=gen)[:37]
    k_cache = torch.full((slots, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q = native.rotary_store(
        qkv, heads, kv_heads, positions, cos_sin, k_cache, v_cache, slot_mapping
    )
    q_ref, k_ref = rotary_ref.apply_rotary(
        qkv[:, : heads * dim].view(37, heads, dim),
        qkv[:, heads * dim : (heads + kv_heads) * dim].view(37, kv_heads, dim),
        positions,
        cos_sin,
    )
    v_ref = qkv[:, (heads + kv_heads) * dim :].reshape(37, kv_heads, dim)
    kv_store_ref.store_kv(want_k, want_v, k_ref, v_ref, slot_mapping)
    assert torch.equal(q, q_ref)  # rotary is exact in both dtypes
    assert torch.equal(k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0))  # other slots untouched
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [
        (9, 3, 64, 16),
        (4, 4, 64, 1),
        (8, 2, 128, 16),
        (16, 1, 64, 7),
        (8, 4, 256, 16),
        (10, 2, 64, 16),  # a group of 5: items of 12 queries on AVX2 (60 rows, 8-row vectors)
    ],
)
def test_native_extend_matches_the_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int
) -> None:
    from asyncengine.kernels.cpu.attention_native import (
        extend_kernel_runs,
        native_extend_attention,
        plan_native_extend,
    )
    from asyncengine.kernels.reference.attention_ref import extend_attention

    # fresh prompts, prompts over a cached prefix, a one-token extend, query blocks of 16 split;
    # a chunk whose last query block (3 queries at 190..192) crosses a 16-key block border, so
    # that a tile of 4 rows mixes query heads (its rows' positions are not in order)
    seq_lens = [50, 300, 17, 64, 129, 33, 193]
    q_lens = [50, 120, 1, 33, 16, 33, 35]
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, dtype, seed=head_dim + page_size)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(int(cu[-1]), num_heads + 2, head_dim, generator=gen).to(dtype)
    q = wide[:, :num_heads]  # rows strided, heads contiguous, as the model hands them over
    scale = head_dim**-0.5
    plan = plan_native_extend(kv.block_table, cu, kv.seq_lens, page_size, num_heads, kv.k_cache)
    if not extend_kernel_runs():
        assert plan is None  # no AVX-512 build: extends keep the torch path
        return
    assert plan is not None
    got = native_extend_attention(q, kv.k_cache, kv.v_cache, plan, scale)
    ref = extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, cu, kv.seq_lens, page_size, scale
    )
    assert torch.isfinite(got.float()).all(), "read a slot no request owns"
    torch.testing.assert_close(got.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), q_lens, strict=True)):
        want = naive_attention(q[start : start + n].float(), kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(
            got[start : start + n].float(), want, atol=TOLERANCE[dtype], rtol=0
        )


def test_native_extend_runs_on_avx2_and_avx512_cpus() -> None:
    """Extends take the native kernel wherever it has items for the CPU (AVX-512, or AVX2 with
    FMA): the torch path is only for other CPUs."""
    from asyncengine.kernels.cpu.attention_native import extend_kernel_runs

    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "avx512f" in flags or {"avx2", "fma"} <= flags:
        assert extend_kernel_runs()


def test_native_extend_leaves_other_head_dims_to_torch() -> None:
    from asyncengine.kernels.cpu.attention_native import plan_native_decode, plan_native_extend

    kv = PagedKV([40], 16, 1, 96, torch.float32, seed=0)  # 96: decode handles it, extend does not
    cu = torch.tensor([0, 40], dtype=torch.int32)
    assert plan_native_extend(kv.block_table, cu, kv.seq_lens, 16, 1, kv.k_cache) is None
    assert plan_native_decode(kv.block_table, kv.seq_lens, 16, 1, kv.k_cache) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("window", "softcap"), [(8, 0.0), (1, 0.0), (40, 0.0), (0, 1.5), (23, 5.0)]
)
def test_native_extend_with_window_and_softcap_matches_naive(
    dtype: torch.dtype, window: int, softcap: float
) -> None:
    """Gemma 2/3 layers: windows inside one 16-key block, across blocks, of one key; soft-caps
    that bite. Prompts after long cached prefixes (whole key blocks below every window are
    skipped) and one-query extends (decodes, as deterministic mode routes them)."""
    from asyncengine.kernels.cpu.attention_native import (
        extend_kernel_runs,
        native_extend_attention,
        plan_native_extend,
    )

    seq_lens = [50, 300, 17, 64, 129, 193, 90]
    q_lens = [50, 120, 1, 33, 16, 35, 1]
    kv = PagedKV(seq_lens, 16, 2, 64, dtype, seed=window + 3)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    q = (torch.randn(int(cu[-1]), 8, 64, generator=gen) * 3).to(dtype)
    plan = plan_native_extend(kv.block_table, cu, kv.seq_lens, 16, 8, kv.k_cache)
    if not extend_kernel_runs():
        assert plan is None
        return
    assert plan is not None
    got = native_extend_attention(q, kv.k_cache, kv.v_cache, plan, 0.125, window, softcap)
    assert torch.isfinite(got.float()).all()
    plain = native_extend_attention(q, kv.k_cache, kv.v_cache, plan, 0.125)
    assert not torch.allclose(got.float(), plain.float(), atol=0.1), "the options must matter"
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), q_lens, strict=True)):
        rows = slice(start, start + n)
        want = naive_attention(q[rows].float(), kv.keys[b], kv.values[b], 0.125, window, softcap)
        torch.testing.assert_close(got[rows].float(), want, atol=TOLERANCE[dtype], rtol=0)


def test_decodes_of_window_layers_go_through_the_decode_kernel() -> None:
    """TorchBackend: a windowed, soft-capped layer's decodes and a plain layer's through the
    native decode kernel, with one plan, both right."""
    from asyncengine.executor.attention.torch_backend import (
        PLAIN,
        AttentionOptions,
        TorchAttentionMetadata,
        TorchBackend,
    )
    from asyncengine.executor.forward_batch import ForwardBatch
    from asyncengine.kernels.cpu.attention_native import NativeDecodePlan

    seq_lens = [40, 9, 77]
    kv = PagedKV(seq_lens, 16, 2, 64, torch.float32, seed=5)
    q = torch.randn(3, 4, 64)
    empty = torch.zeros(0, dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.zeros(3, dtype=torch.int64),
        positions=kv.seq_lens.long() - 1,
        slot_mapping=torch.zeros(3, dtype=torch.int64),
        sample_indices=torch.arange(3),
        page_size=16,
        num_extend_tokens=0,
        extend_block_table=torch.zeros((0, 0), dtype=torch.int32),
        extend_seq_lens=empty,
        extend_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        extend_max_q_len=0,
        extend_max_seq_len=0,
        decode_block_table=kv.block_table,
        decode_seq_lens=kv.seq_lens,
        decode_max_seq_len=77,
    )
    backend = TorchBackend()
    metadata = TorchAttentionMetadata(batch)
    windowed = backend.attend(q, kv.k_cache, kv.v_cache, metadata, 0.125, AttentionOptions(6, 2.0))
    plain = backend.attend(q, kv.k_cache, kv.v_cache, metadata, 0.125, PLAIN)
    assert isinstance(metadata.decode_plan, NativeDecodePlan)  # the CI machines compile it
    for b in range(3):
        want = naive_attention(q[b : b + 1], kv.keys[b], kv.values[b], 0.125, 6, 2.0)[0]
        torch.testing.assert_close(windowed[b], want, atol=2e-5, rtol=0)
        want = naive_attention(q[b : b + 1], kv.keys[b], kv.values[b], 0.125)[0]
        torch.testing.assert_close(plain[b], want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), [(64, 8, 2), (256, 4, 1)])
@pytest.mark.parametrize(("window", "softcap"), [(7, 0.0), (0, 1.5), (40, 2.0)])
def test_native_decode_window_and_softcap(
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    window: int,
    softcap: float,
    threads: int,
) -> None:
    """The decode kernel's window (its last ``window`` keys) and soft-cap against the naive
    attention, on both item shapes (``threads``) and Gemma's head_dim 256; lengths below, at
    and above the window, and windows that start inside a key block."""
    seq_lens = [1, 7, 8, 40, 41, 100, 257, 30]
    kv = PagedKV(seq_lens, 16, num_kv_heads, head_dim, dtype, seed=window + head_dim)
    gen = torch.Generator().manual_seed(6)
    q = (torch.randn(len(seq_lens), num_heads, head_dim, generator=gen) * 3).to(dtype)
    scale = head_dim**-0.5
    plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, num_heads, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, scale, window, softcap)
    plain = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, scale)
    assert not torch.allclose(got.float(), plain.float(), atol=0.05), "the options must matter"
    for b in range(len(seq_lens)):
        want = naive_attention(
            q[b : b + 1].float(), kv.keys[b], kv.values[b], scale, window, softcap
        )
        torch.testing.assert_close(got[b].float(), want[0], atol=TOLERANCE[dtype], rtol=0)


def test_load_all_builds_every_library_once_and_compiles_side_by_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every C file, and the K/V libraries again with the pool's flags, each asked for once; the
    builds overlap where the machine has more than one core (a first start's ~15 compiles)."""
    import threading
    import time

    calls: list[tuple[str, tuple[str, ...]]] = []
    running, most = 0, 0
    lock = threading.Lock()

    def fake_load(name: str, extra_flags: tuple[str, ...] = ()) -> object | None:
        nonlocal running, most
        with lock:
            calls.append((name, extra_flags))
            running += 1
            most = max(most, running)
        time.sleep(0.05)  # a compiler's process
        with lock:
            running -= 1
        return None if name == "cpu_lora" else object()

    monkeypatch.setattr(cpu_native, "load", fake_load)
    monkeypatch.setattr(cpu_native.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    sources = sorted(p.stem for p in cpu_native.SOURCE_DIR.glob("*.c"))
    loaded = cpu_native.load_all(("-DKV_F16",))
    expected = [(s, ()) for s in sources] + [(n, ("-DKV_F16",)) for n in cpu_native.KV_LIBRARIES]
    assert sorted(calls) == sorted(expected)
    assert loaded == len(expected) - 1  # cpu_lora "did not compile"
    assert most == 2
