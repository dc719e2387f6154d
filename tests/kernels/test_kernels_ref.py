"""The torch kernel references against naive, obviously-right implementations."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.kernels.attention_grouping import ExtendCost
from asyncengine.kernels.reference import attention_ref, decode_sparse_ref
from asyncengine.kernels.reference.activation_ref import silu_and_mul
from asyncengine.kernels.reference.attention_ref import (
    GatherDecodePlan,
    decode_attention,
    decode_attention_planned,
    extend_attention,
    extend_attention_planned,
    plan_extend,
    plan_gather_decode,
)
from asyncengine.kernels.reference.decode_sparse_ref import SparseDecodePlan
from asyncengine.kernels.reference.kv_store_ref import store_kv
from asyncengine.kernels.reference.norm_ref import fused_add_rms_norm, rms_norm
from asyncengine.kernels.reference.rotary_ref import apply_rotary

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class PagedKV:
    """Random requests' K/V written into a pool whose pages are handed out shuffled."""

    def __init__(
        self,
        seq_lens: list[int],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        pages_needed = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages_needed) + 2
        order = torch.randperm(num_pages, generator=gen)
        width = max(pages_needed)
        self.block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        slots = num_pages * page_size
        # NaN in every slot no request owns: reading one poisons the result
        self.k_cache = torch.full((slots, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        self.v_cache = torch.full((slots, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        used = 0
        for b, n in enumerate(seq_lens):
            pages = order[used : used + pages_needed[b]]
            used += pages_needed[b]
            self.block_table[b, : len(pages)] = pages.to(torch.int32)
            pos = torch.arange(n)
            slot = pages[pos // page_size] * page_size + pos % page_size
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            self.k_cache[slot] = k
            self.v_cache[slot] = v
            self.keys.append(k)
            self.values.append(v)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One request: q [Lq, H, D] at the last Lq positions of k/v [L, Hkv, D], causal, in fp32;
    a query at p sees keys p - window + 1 .. p (window 0: all), scores soft-capped at softcap."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    lq, lk = q.shape[0], k.shape[1]
    keys, pos = torch.arange(lk)[None, :], (lk - lq + torch.arange(lq))[:, None]
    visible = keys <= pos
    if window:
        visible &= keys > pos - window
    if not softcap:
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1), k, v, attn_mask=visible, scale=scale
        )
        return out.transpose(0, 1)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


attention_cases = st.fixed_dictionaries(
    {
        "seq_lens": st.lists(st.integers(1, 40), min_size=1, max_size=5),
        "page_size": st.sampled_from([1, 4, 16]),
        "heads": st.sampled_from([(4, 4), (4, 2), (6, 2), (3, 1), (6, 6), (10, 5)]),
        "head_dim": st.sampled_from([8, 16]),
        "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
        "seed": st.integers(0, 2**16),
        "chunk_bytes": st.sampled_from([1, 2048, attention_ref.DECODE_CHUNK_BYTES]),
        "chunk_entries": st.sampled_from([1, 200, decode_sparse_ref.SPARSE_DECODE_CHUNK_ENTRIES]),
    }
)

# extend bucket prices: the default, one bucket per distinct length, one bucket for all
EXTEND_COSTS = {
    "default": None,
    "split": ExtendCost(pair=1.0, key=1.0, call=0.0),
    "single": ExtendCost(pair=1.0, key=1.0, call=float("inf")),
}


@settings(max_examples=40, deadline=None)
@given(case=attention_cases)
def test_decode_attention_matches_per_request_sdpa(case: dict) -> None:
    num_heads, num_kv_heads = case["heads"]
    dtype = case["dtype"]
    kv = PagedKV(
        case["seq_lens"], case["page_size"], num_kv_heads, case["head_dim"], dtype, case["seed"]
    )
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    batch = len(case["seq_lens"])
    q = torch.randn(batch, num_heads, case["head_dim"], generator=gen).to(dtype)
    scale = case["head_dim"] ** -0.5
    with (
        mock.patch.object(attention_ref, "DECODE_CHUNK_BYTES", case["chunk_bytes"]),
        mock.patch.object(decode_sparse_ref, "SPARSE_DECODE_CHUNK_ENTRIES", case["chunk_entries"]),
    ):
        out = decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, kv.page_size, scale
        )
    assert out.shape == q.shape and out.dtype == dtype
    for b in range(batch):
        want = naive_attention(q[b : b + 1], kv.keys[b], kv.values[b], scale)[0]
        torch.testing.assert_close(
            out[b].float(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_plans_by_dtype(dtype: torch.dtype) -> None:
    """Float32 reads the pool in place; other dtypes gather (float32 scores need their own
    matmuls there). Both paths are checked against per-request SDPA above."""
    kv = PagedKV([5, 9], page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, seed=0)
    plan = attention_ref.plan_decode(kv.block_table, kv.seq_lens, 4, 4, kv.k_cache)
    want = SparseDecodePlan if dtype == torch.float32 else GatherDecodePlan
    assert isinstance(plan, want)


@settings(max_examples=25, deadline=None)
@given(case=attention_cases)
def test_gathered_decode_of_float32_matches_per_request_sdpa(case: dict) -> None:
    """The gather path, which float32 does not take by default, in float32."""
    num_heads, num_kv_heads = case["heads"]
    kv = PagedKV(
        case["seq_lens"], case["page_size"], num_kv_heads, case["head_dim"], torch.float32, 1
    )
    q = torch.randn(len(case["seq_lens"]), num_heads, case["head_dim"])
    scale = case["head_dim"] ** -0.5
    with mock.patch.object(attention_ref, "DECODE_CHUNK_BYTES", case["chunk_bytes"]):
        plan = plan_gather_decode(kv.block_table, kv.seq_lens, kv.page_size, kv.k_cache)
    out = decode_attention_planned(q, kv.k_cache, kv.v_cache, plan, scale)
    for b in range(len(case["seq_lens"])):
        want = naive_attention(q[b : b + 1], kv.keys[b], kv.values[b], scale)[0]
        torch.testing.assert_close(out[b], want, rtol=2e-5, atol=2e-5)


@settings(max_examples=40, deadline=None)
@given(case=attention_cases, data=st.data(), cost=st.sampled_from(sorted(EXTEND_COSTS)))
def test_extend_attention_matches_per_request_causal_sdpa(
    case: dict, data: st.DataObject, cost: str
) -> None:
    num_heads, num_kv_heads = case["heads"]
    dtype = case["dtype"]
    seq_lens = case["seq_lens"]
    # each request extends by its last q_len tokens; the rest is its cached prefix
    q_lens = [data.draw(st.integers(1, n)) for n in seq_lens]
    kv = PagedKV(seq_lens, case["page_size"], num_kv_heads, case["head_dim"], dtype, case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(sum(q_lens), num_heads, case["head_dim"], generator=gen).to(dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    scale = case["head_dim"] ** -0.5
    plan = plan_extend(
        kv.block_table, cu, kv.seq_lens, kv.page_size, num_heads, kv.k_cache, EXTEND_COSTS[cost]
    )
    out = extend_attention_planned(q, kv.k_cache, kv.v_cache, plan, scale)
    assert out.shape == q.shape and out.dtype == dtype
    for b in range(len(seq_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = naive_attention(q[rows], kv.keys[b], kv.values[b], scale)
        torch.testing.assert_close(
            out[rows].float(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_attention_of_a_lone_prefill_is_causal(dtype: torch.dtype) -> None:
    kv = PagedKV([37], page_size=16, num_kv_heads=2, head_dim=16, dtype=dtype, seed=5)
    q = torch.randn(37, 6, 16).to(dtype)
    cu = torch.tensor([0, 37], dtype=torch.int32)
    out = extend_attention(q, kv.k_cache, kv.v_cache, kv.block_table, cu, kv.seq_lens, 16, 0.25)
    want = naive_attention(q, kv.keys[0], kv.values[0], 0.25)
    torch.testing.assert_close(out.float(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cost", sorted(EXTEND_COSTS))
@pytest.mark.parametrize("cached", [True, False])
def test_ragged_extends_in_buckets_equal_each_request_alone(
    page_size: int, cost: str, cached: bool
) -> None:
    """Prompts of very different lengths, with or without cached prefixes (ending mid-page):
    the bucketed batch gives every request what it gets alone (and what naive attention gives).
    Without prefixes, buckets of several lengths run causal over padded grids."""
    prefixes = [0, 5, 0, 17, 33, 0, 2, 0] if cached else [0] * 8
    q_lens = [3, 40, 97, 9, 1, 200, 61, 12]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    kv = PagedKV(seq_lens, page_size, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=3)
    q = torch.randn(sum(q_lens), 6, 16)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    plan = plan_extend(
        kv.block_table, cu, kv.seq_lens, page_size, 6, kv.k_cache, EXTEND_COSTS[cost]
    )
    if cost == "split":
        assert len(plan.buckets) > 1
    if cost == "single":
        assert len(plan.buckets) == 1
        assert (plan.buckets[0].mask is None) == (not cached)
    out = extend_attention_planned(q, kv.k_cache, kv.v_cache, plan, 0.25)
    for b in range(len(q_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = extend_attention(
            q[rows],
            kv.k_cache,
            kv.v_cache,
            kv.block_table[b : b + 1],
            torch.tensor([0, q_lens[b]], dtype=torch.int32),
            kv.seq_lens[b : b + 1],
            page_size,
            0.25,
        )
        torch.testing.assert_close(out[rows], alone, rtol=1e-5, atol=1e-5)
        want = naive_attention(q[rows], kv.keys[b], kv.values[b], 0.25)
        torch.testing.assert_close(out[rows], want, rtol=2e-5, atol=2e-5)


def test_store_kv_writes_only_the_given_slots() -> None:
    k_cache = torch.zeros(10, 2, 4)
    v_cache = torch.zeros(10, 2, 4)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    slots = torch.tensor([7, 2, 5])
    store_kv(k_cache, v_cache, k, v, slots)
    torch.testing.assert_close(k_cache[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache[slots], v, rtol=0, atol=0)
    untouched = [i for i in range(10) if i not in (7, 2, 5)]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = (torch.randn(5, 32) * 3).to(dtype)
    hf = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(32))
        want = hf(x)
    torch.testing.assert_close(rms_norm(x, hf.weight.detach(), 1e-5), want, rtol=0, atol=0)


def test_fused_add_rms_norm_is_add_then_norm() -> None:
    x, residual, weight = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    y, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    naive_sum = x + residual
    naive_y = naive_sum / naive_sum.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * weight
    torch.testing.assert_close(summed, naive_sum)
    torch.testing.assert_close(y, naive_y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_hf(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim, max_pos = 16, 50
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.tensor([0, 3, 49, 7, 7])
    q = torch.randn(5, 4, head_dim).to(dtype)
    k = torch.randn(5, 2, head_dim).to(dtype)
    emb = torch.cat((freqs, freqs), dim=-1)[positions]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # HF layout: [batch, heads, seq, dim]; cos/sin [batch, seq, dim]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    got_q, got_k = apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=0)


def test_silu_and_mul_is_gate_activation_times_up() -> None:
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(silu_and_mul(torch.cat([gate, up], dim=-1)), want)


@settings(max_examples=25, deadline=None)
@given(
    case=attention_cases,
    data=st.data(),
    window=st.sampled_from([0, 1, 3, 8]),
    softcap=st.sampled_from([0.0, 0.5, 2.0]),
)
def test_window_and_softcap_match_naive_attention(
    case: dict, data: st.DataObject, window: int, softcap: float
) -> None:
    """Every reference path with a sliding window and soft-capping (Gemma 2/3): bucketed
    extends over cached prefixes, decodes in place (float32) and gathered in chunks."""
    num_heads, num_kv_heads = case["heads"]
    dtype, seq_lens = case["dtype"], case["seq_lens"]
    q_lens = [data.draw(st.integers(1, n)) for n in seq_lens]
    kv = PagedKV(seq_lens, case["page_size"], num_kv_heads, case["head_dim"], dtype, case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    q = (torch.randn(sum(q_lens), num_heads, case["head_dim"], generator=gen) * 3).to(dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    scale, tol = case["head_dim"] ** -0.5, TOLERANCE[dtype]
    plan = plan_extend(kv.block_table, cu, kv.seq_lens, kv.page_size, num_heads, kv.k_cache)
    out = extend_attention_planned(q, kv.k_cache, kv.v_cache, plan, scale, window, softcap)
    for b in range(len(seq_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = naive_attention(q[rows], kv.keys[b], kv.values[b], scale, window, softcap)
        torch.testing.assert_close(out[rows].float(), want, rtol=tol, atol=tol)

    last = q[cu[1:].long() - 1]  # each request's last query, as a decode
    with (
        mock.patch.object(attention_ref, "DECODE_CHUNK_BYTES", case["chunk_bytes"]),
        mock.patch.object(decode_sparse_ref, "SPARSE_DECODE_CHUNK_ENTRIES", case["chunk_entries"]),
    ):
        plans = [
            attention_ref.plan_decode(
                kv.block_table, kv.seq_lens, kv.page_size, num_heads, kv.k_cache
            )
        ]
        plans.append(plan_gather_decode(kv.block_table, kv.seq_lens, kv.page_size, kv.k_cache))
    for decode_plan in plans:
        out = decode_attention_planned(
            last, kv.k_cache, kv.v_cache, decode_plan, scale, window, softcap
        )
        for b in range(len(seq_lens)):
            want = naive_attention(
                last[b : b + 1], kv.keys[b], kv.values[b], scale, window, softcap
            )
            torch.testing.assert_close(out[b].float(), want[0], rtol=tol, atol=tol)


def test_window_and_softcap_change_the_output() -> None:
    """The naive oracle itself: a window hides early keys, a soft-cap flattens the scores."""
    kv = PagedKV([20], page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32, seed=2)
    q = torch.randn(20, 2, 8) * 3
    plain = naive_attention(q, kv.keys[0], kv.values[0], 0.35)
    for window, softcap in ((5, 0.0), (0, 1.0)):
        changed = naive_attention(q, kv.keys[0], kv.values[0], 0.35, window, softcap)
        assert not torch.allclose(changed[-1], plain[-1], atol=1e-3)
    short = naive_attention(q, kv.keys[0], kv.values[0], 0.35, window=1)
    torch.testing.assert_close(short, kv.values[0].repeat_interleave(2, dim=1))  # itself only
