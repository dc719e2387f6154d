"""An int8 K/V pool (a bfloat16 scale per token and head after each head's row: kv_int8_ref.py)
written and read by the native kernels' -DKV_I8 builds (kernels/cpu/cpu_kv.h), on this CPU's
widest ISA and forced to AVX2 (-mno-avx512f), beside float32 activations (bfloat16 ones:
test_kv_int8_bf16.py).

Two oracles: the torch references over the same int8 pool (they dequantize the rows, then both
sides compute in float32 on the same values: the float32 tolerance ATOL holds), and float32
attention over the unquantized keys and values (the rounding to int8 moves the output by at
most INT8_ATOL here: unit-variance K/V, a step of amax / 127 per row)."""

from __future__ import annotations

from collections.abc import Iterator

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
from asyncengine.kernels.reference.kv_int8_ref import (
    SCALE_BYTES,
    dequantize_kv,
    quantize_kv,
    quantize_query,
    row_scales,
)
from asyncengine.kernels.reference.kv_store_ref import store_kv
from asyncengine.kernels.reference.rotary_ref import apply_rotary
from tests.kernels.test_kernels_ref import TOLERANCE, naive_attention
from tests.native_support import needs_native

pytestmark = needs_native
I8, F32 = torch.int8, torch.float32
ATOL = TOLERANCE[F32]
# int8 K/V against float32 K/V, unit-variance rows of 64..256: the output's largest move
INT8_ATOL = 0.05
# where the decode attention sums the values in integers too (AVX-512 VNNI,
# cpu_stream_i8_values.h) each weight is rounded to 16 bits of its block's largest: that moves
# an output by up to ~4e-5 here (unit-variance values), so the float32 tolerance and that
I8_VALUES_ATOL = 1e-4
ISAS = {"native": ("-DKV_I8",), "avx2": ("-DKV_I8", "-mno-avx512f")}
NAN_SCALE = torch.tensor([float("nan")], dtype=torch.bfloat16).view(I8)


@pytest.fixture(params=list(ISAS))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every kernel of the test built for that ISA (the int8 builds' flags swapped in)."""
    flags = ISAS[request.param]
    monkeypatch.setattr(cpu_native, "_KV_I8_FLAGS", flags)
    monkeypatch.setitem(decode_step_native.KV_BUILD_FLAGS, I8, flags)
    decode_step_native._library.cache_clear()
    yield request.param
    decode_step_native._library.cache_clear()


def query_as_read(q: torch.Tensor) -> torch.Tensor:
    """The decode attention's queries as this build computes with them: rounded to int8 per
    head where it takes Q.K in integers (AVX-512 VNNI, cpu_stream_i8_dots.h), else as they are."""
    return quantize_query(q) if cpu_native.kv_i8_query_dots(q.shape[-1]) else q


def atol_as_read(head_dim: int) -> float:
    """The tolerance against the reference over ``query_as_read``: the float32 one, or
    I8_VALUES_ATOL where the build sums the values in integers (the same heads as the query)."""
    return I8_VALUES_ATOL if cpu_native.kv_i8_query_dots(head_dim) else ATOL


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


class PagedInt8KV:
    """Random requests' K/V quantized into an int8 pool whose pages are handed out shuffled;
    every slot no request owns has a NaN scale (reading one poisons the result)."""

    def __init__(
        self, seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int, seed: int
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages_needed = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages_needed) + 2
        order = torch.randperm(num_pages, generator=gen)
        self.block_table = torch.zeros(len(seq_lens), max(pages_needed), dtype=torch.int32)
        shape = (num_pages * page_size, num_kv_heads, head_dim + SCALE_BYTES)
        self.k_cache = torch.zeros(shape, dtype=I8)
        self.k_cache[..., head_dim:] = NAN_SCALE
        self.v_cache = self.k_cache.clone()
        self.keys: list[torch.Tensor] = []  # float32, before quantization
        self.values: list[torch.Tensor] = []
        used = 0
        for b, n in enumerate(seq_lens):
            pages = order[used : used + pages_needed[b]]
            used += pages_needed[b]
            self.block_table[b, : len(pages)] = pages.to(torch.int32)
            pos = torch.arange(n)
            slot = pages[pos // page_size] * page_size + pos % page_size
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            self.k_cache[slot] = quantize_kv(k)
            self.v_cache[slot] = quantize_kv(v)
            self.keys.append(k)
            self.values.append(v)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)


def test_quantize_round_trip_and_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=gen) * torch.logspace(-6, 3, 50)[:, None, None]
    x[3] = 0.0  # an all-zero row: scale 0, values 0
    rows = quantize_kv(x)
    assert rows.dtype == I8 and rows.shape == (50, 4, 66)
    scales = row_scales(rows)
    assert (scales >= x.abs().amax(-1, keepdim=True) / 127).all()  # rounded up: no clamping
    back = dequantize_kv(rows)
    assert (back - x).abs().le(scales / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[3], torch.zeros_like(back[3]))
    assert rows[..., :64].abs().max() <= 127


def test_the_int8_builds_load_and_say_so(isa: str) -> None:
    for name in cpu_native.KV_LIBRARIES:
        lib = cpu_native.load(name, ISAS[isa])
        assert lib is not None, name
        assert lib.asyncengine_kv_element() == cpu_native.KV_I8_ELEMENT
    assert cpu_native.kv_i8_native()


SHAPES = [(9, 3, 64, 16), (4, 4, 64, 1), (8, 2, 128, 16), (16, 2, 64, 7), (8, 1, 128, 5)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "page_size"), SHAPES)
@pytest.mark.parametrize("seq_lens", [[1, 31, 32, 33, 70, 5, 129, 64], [1500], [700, 2051]])
def test_native_decode_reads_an_int8_pool(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    isa: str,
    threads: int,
) -> None:
    kv = PagedInt8KV(seq_lens, page_size, num_kv_heads, head_dim, seed=head_dim + page_size)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    plan = plan_native_decode(kv.block_table, kv.seq_lens, page_size, num_heads, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, scale)
    ref = decode_attention(
        query_as_read(q), kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale
    )
    assert got.dtype == F32 and torch.isfinite(got).all(), "read a slot no request owns"
    torch.testing.assert_close(got, ref, atol=atol_as_read(head_dim), rtol=0)
    for b in range(len(seq_lens)):
        want = naive_attention(q[b : b + 1], kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(got[b], want[0], atol=INT8_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("seq_lens", "window"),
    [([40, 3, 100], 7), ([1500], 700), ([40, 3, 100, 17, 64, 65, 1, 33, 200, 9, 48, 90], 0)],
    ids=["3", "split-K", "whole-requests"],
)
def test_native_decode_window_and_softcap_over_int8(
    seq_lens: list[int], window: int, isa: str
) -> None:
    kv = PagedInt8KV(seq_lens, 16, 2, 64, seed=5)
    q = torch.randn(len(seq_lens), 8, 64, generator=torch.Generator().manual_seed(3))
    plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, 8, kv.k_cache)
    assert plan is not None
    got = native_decode_attention(q, kv.k_cache, kv.v_cache, plan, 0.125, window, 1.5)
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, 16, 0.125, window)
    ref = decode_attention(query_as_read(q), *args, 1.5)
    torch.testing.assert_close(got, ref, atol=atol_as_read(64), rtol=0)
    uncapped = decode_attention(query_as_read(q), *args)
    assert not torch.allclose(got, uncapped, atol=0.05), "the cap must matter"


def test_an_int8_pool_refuses_float16_queries() -> None:
    kv = PagedInt8KV([5], 16, 1, 64, seed=0)
    plan = plan_native_decode(kv.block_table, kv.seq_lens, 16, 2, kv.k_cache)
    assert plan is not None
    with pytest.raises(ValueError, match="int8 KV pool is read with float32 or bfloat16 queries"):
        native_decode_attention(
            torch.zeros(1, 2, 64, dtype=torch.float16), kv.k_cache, kv.v_cache, plan, 1.0
        )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [
        (9, 3, 64, 16),
        (4, 4, 64, 1),
        (8, 2, 128, 16),
        (16, 2, 64, 7),
        (8, 1, 128, 5),
        (8, 4, 256, 16),
    ],
)
def test_native_extend_reads_an_int8_pool(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, isa: str
) -> None:
    if not extend_kernel_runs(I8):
        pytest.skip("no AVX2 + FMA or AVX-512 here: extends take the torch path")
    seq_lens = [50, 300, 17, 64, 129, 33, 193]
    q_lens = [50, 120, 1, 33, 16, 33, 35]
    kv = PagedInt8KV(seq_lens, page_size, num_kv_heads, head_dim, seed=head_dim + page_size)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=torch.Generator().manual_seed(2))
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
        torch.testing.assert_close(got[start : start + n], want, atol=INT8_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size"),
    [
        (9, 3, 64, 16),
        (16, 2, 64, 7),
        (12, 1, 120, 5),
        (6, 2, 20, 3),
        (32, 4, 128, 16),
        (8, 8, 64, 3),
    ],
)
@pytest.mark.parametrize(
    "seq_lens",
    [
        [1, 31, 32, 33, 70, 5, 129, 64],
        [97],
        [40, 3, 65, 17, 250, 1, 96, 33, 12, 64, 31, 8, 77],
        [1500],  # split-K
        [700, 2051],
    ],
)
def test_fused_step_attention_reads_an_int8_pool(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    isa: str,
    threads: int,
) -> None:
    kv = PagedInt8KV(seq_lens, page_size, num_kv_heads, head_dim, seed=head_dim)
    q = torch.randn(
        len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(page_size)
    )
    scale = head_dim**-0.5
    args = (kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, page_size, scale)
    got = decode_step_native.group_attention(q, *args)
    ref = decode_attention(query_as_read(q), *args)
    assert torch.isfinite(got).all(), "read a slot no request owns"
    torch.testing.assert_close(got, ref, atol=atol_as_read(head_dim), rtol=0)
    for b in range(len(seq_lens)):
        want = naive_attention(q[b : b + 1], kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(got[b], want[0], atol=INT8_ATOL, rtol=0)


@pytest.mark.parametrize(("dtype", "q_atol"), [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
def test_rotary_store_quantizes_k_and_v_as_the_reference_does(
    isa: str, dtype: torch.dtype, q_atol: float
) -> None:
    """float32 or bfloat16 rows (a bfloat16 model's): the same scales, the same rounding."""
    n, heads, kv_heads, d, slots = 7, 6, 2, 64, 40
    gen = torch.Generator().manual_seed(4)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen) * 3).to(dtype)
    qkv[2] = 0.0  # a zero row: scale 0
    positions = torch.tensor([0, 5, 9, 100, 3, 77, 12])
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(128).float()[:, None] * freqs[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    slot_mapping = torch.tensor([3, 17, 0, 39, 8, 22, 31])
    k_cache = torch.full((slots, kv_heads, d + SCALE_BYTES), 99, dtype=I8)
    v_cache = k_cache.clone()
    q = layer_ops_native.rotary_store(
        qkv, heads, kv_heads, positions, cos_sin, k_cache, v_cache, slot_mapping
    )
    q_all, k_all, v_all = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q_ref, k_ref = apply_rotary(
        q_all.reshape(n, heads, d), k_all.reshape(n, kv_heads, d), positions, cos_sin
    )
    want_k = torch.full_like(k_cache, 99)
    want_v = want_k.clone()
    store_kv(want_k, want_v, k_ref, v_all.reshape(n, kv_heads, d), slot_mapping)
    assert q.dtype == dtype
    torch.testing.assert_close(q, q_ref, atol=q_atol, rtol=0)
    assert torch.equal(k_cache, want_k)  # bit for bit: the same scale, the same rounding
    assert torch.equal(v_cache, want_v)
