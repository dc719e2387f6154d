"""Batch-invariant attention (torch): a query row's output does not depend on the other requests
of the forward, on how its prompt was chunked, or on how much of it came from the prefix cache.

The fused attention kernel (``scaled_dot_product_attention``) runs an online softmax over key
blocks, and on the CPU the block is ``min(keys, 512)`` long: a request attended alone over 200
keys is summed in one block of 200, the same request padded to 250 keys in a batch in one block
of 250, and the two round differently in bfloat16. Here every request's keys are padded (masked
out) to a multiple of ``KEY_BLOCK`` = 512, so the kernel always cuts keys at absolute positions
0, 512, 1024, ...; masked keys add exact zeros, and which query rows share a call changes
nothing (each row is reduced on its own) as long as no block of queries is shorter than 4 rows
(``padded_queries``). Decodes are one-query extends in the same layout, so a token computed in
a prefill (a retracted request recomputed) equals the one its decode made.

Per forward the requests are grouped by (decode or extend, padded key length); each group is
one attention call over [requests, KV heads, longest query x query heads per KV head, padded
keys] with an explicit mask.
Short contexts pay for the padding: a decode at 40 tokens reads 512 keys (most of them the
last real key again, masked). scripts/bench_deterministic.py measures the cost.

Sliding-window layers get their own mask (made once per forward and window). Soft-capped
layers (Gemma 2) cannot use the fused attention (it has no soft-cap): their scores are computed
explicitly (``_softcapped_attention``: q @ k^T, cap * tanh(s / cap), the mask, a softmax over
the padded keys, then p @ v) in float64, because a BLAS product may split its sums differently
with the batch's shape: in float64 such a difference is ~1e-16 relative, far below the float32
or bfloat16 rounding of the result, so the same rows come out alone or batched (tested in both
dtypes; slow, but only Gemma 2 in deterministic mode without the native kernel takes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from asyncengine.executor.attention.torch_backend import (
    PLAIN,
    AttentionOptions,
    BatchMetadata,
    StoreThenAttendBackend,
)
from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.kernels.paged_kv import padded_kv_slots
from asyncengine.kernels.reference.attention_ref import attention_dtype
from asyncengine.kernels.reference.attention_window import additive_mask, hidden_keys, soft_cap
from asyncengine.kernels.reference.kv_int8_ref import INT8, dequantize_flat

# the CPU flash attention's key block (torch's kernel: min(kv_len, 512)); padding to multiples
# of it fixes the kernel's reduction order (tests/executor/test_deterministic.py checks it holds)
KEY_BLOCK = 512
# A request's query heads that share a KV head are the rows of one attention problem (as the
# CPU decode path lays them out: keys are read once per KV head, and one-query calls avoid the
# kernel's slow single-row path). The kernel cuts those rows into blocks of 32 (64, 256 for
# many rows) and, in float32, multiplies a last block of 1 to 3 rows by another path that
# rounds differently: such row counts are padded away. bfloat16 has no such case in this
# layout. tests/executor/test_deterministic.py tries every tail.
QUERY_BLOCK = 32
_SHORT_TAILS: dict[torch.dtype, frozenset[int]] = {torch.bfloat16: frozenset()}
_SHORT_TAILS_DEFAULT = frozenset({1, 2, 3})


@dataclass(slots=True)
class _Group:
    num_requests: int
    q_len: int
    kv_len: int  # padded: a multiple of KEY_BLOCK
    queries: torch.Tensor  # [n * q_len] rows of q (padding repeats a request's last query)
    kv_offset: int  # first row of this group's keys in the plan's gather
    mask: torch.Tensor  # [n, 1, q_len * group, kv_len] additive, the pool's dtype
    query_pos: torch.Tensor  # [n, q_len] each query row's position
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # like mask, by window

    def mask_for(self, window: int, group: int) -> torch.Tensor:
        if not window:
            return self.mask
        if window not in self.window_masks:
            hidden = hidden_keys(self.query_pos, self.kv_len, window)
            mask = additive_mask(hidden, self.mask.dtype)
            self.window_masks[window] = mask.repeat_interleave(group, dim=1)[:, None]
        return self.window_masks[window]


@dataclass(slots=True)
class InvariantPlan:
    groups: list[_Group]
    key_rows: int  # rows of the padded keys of all groups, group after group
    # the real keys: their pool slots and their rows among the padded ones (padding rows are
    # never written: masked out, any finite value there adds an exact zero)
    kv_slots: torch.Tensor
    kv_rows: torch.Tensor
    output_rows: torch.Tensor  # [N] each token's row among the groups' stacked outputs


@dataclass(slots=True)
class InvariantMetadata(BatchMetadata):
    plan: InvariantPlan | None = None  # made by the first layer (needs the pool's dtype)


@dataclass(frozen=True, slots=True)
class _Request:
    q_start: int  # first query row in the forward
    q_len: int
    kv_len: int  # keys incl. the new tokens
    row: int
    decode: bool


def _requests(batch: ForwardBatch) -> list[_Request]:
    cu = batch.extend_cu_seqlens_q.tolist()
    requests = [
        _Request(cu[i], cu[i + 1] - cu[i], kv, i, False)
        for i, kv in enumerate(batch.extend_seq_lens.tolist())
    ]
    first = batch.num_extend_tokens
    requests += [
        _Request(first + i, 1, kv, i, True) for i, kv in enumerate(batch.decode_seq_lens.tolist())
    ]
    return requests


def padded_keys(kv_len: int) -> int:
    return -(-kv_len // KEY_BLOCK) * KEY_BLOCK


def padded_queries(q_len: int, group: int, dtype: torch.dtype) -> int:
    """Query positions per request so that ``positions * group`` rows end in no short block."""
    short = _SHORT_TAILS.get(dtype, _SHORT_TAILS_DEFAULT)
    while (q_len * group) % QUERY_BLOCK in short:
        q_len += 1
    return q_len


def plan_invariant(
    batch: ForwardBatch,
    k_cache: torch.Tensor,
    num_heads: int,
    query_dtype: torch.dtype | None = None,
) -> InvariantPlan:
    """``query_dtype``: what attention computes in (default: the pool's, float32 for an int8
    pool); an int8 pool's rows are dequantized to it."""
    device = k_cache.device
    dtype = query_dtype or attention_dtype(k_cache.dtype)
    group = num_heads // k_cache.shape[1]
    groups_of: dict[tuple[bool, int], list[_Request]] = {}
    for req in _requests(batch):
        groups_of.setdefault((req.decode, padded_keys(req.kv_len)), []).append(req)
    groups: list[_Group] = []
    slots: list[torch.Tensor] = []
    rows_of_keys: list[torch.Tensor] = []
    output_rows = torch.empty(batch.num_tokens, dtype=torch.int64, device=device)
    kv_offset = out_offset = 0
    for (decode, kv_len), members in groups_of.items():
        table = batch.decode_block_table if decode else batch.extend_block_table
        q_len = padded_queries(max(r.q_len for r in members), group, dtype)
        n = len(members)
        rows = torch.tensor([r.row for r in members], dtype=torch.int64, device=device)
        kv_lens = torch.tensor([r.kv_len for r in members], dtype=torch.int64, device=device)
        q_lens = torch.tensor([r.q_len for r in members], dtype=torch.int64, device=device)
        starts = torch.tensor([r.q_start for r in members], dtype=torch.int64, device=device)
        padded = padded_kv_slots(table[rows], kv_lens, kv_len, batch.page_size)
        is_key = torch.arange(kv_len, device=device)[None, :] < kv_lens[:, None]
        slots.append(padded[is_key])
        key_rows = kv_offset + torch.arange(n * kv_len, device=device).view(n, kv_len)
        rows_of_keys.append(key_rows[is_key])
        steps = torch.arange(q_len, device=device)
        taken = torch.minimum(steps[None, :], q_lens[:, None] - 1)  # [n, q_len]
        real = steps[None, :] < q_lens[:, None]
        padded_rows = out_offset + torch.arange(n * q_len, device=device).view(n, q_len)
        output_rows[(starts[:, None] + taken)[real]] = padded_rows[real]
        query_pos = (kv_lens - q_lens)[:, None] + taken  # each query row's own position
        keys = torch.arange(kv_len, device=device)
        hidden = keys[None, None, :] > query_pos[:, :, None]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
        # [n, 1, q_len * group, kv_len]: a position's row for each query head of a KV head
        mask = mask.masked_fill_(hidden, float("-inf")).repeat_interleave(group, dim=1)[:, None]
        queries = (starts[:, None] + taken).reshape(-1)
        groups.append(_Group(n, q_len, kv_len, queries, kv_offset, mask, query_pos))
        kv_offset += n * kv_len
        out_offset += n * q_len
    return InvariantPlan(groups, kv_offset, torch.cat(slots), torch.cat(rows_of_keys), output_rows)


class KeyBuffers:
    """The padded K and V rows, kept from forward to forward (zeros when first made, so that a
    padding row always holds a finite value)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def take(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = like[0].numel()
        k = self.k
        if k is None or k.shape[0] < rows or k.shape[1] != width or k.dtype != like.dtype:
            shape = (max(rows, 2 * (0 if k is None else k.shape[0])), width)
            self.k = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.v = torch.zeros(shape, dtype=like.dtype, device=like.device)
        assert self.k is not None and self.v is not None
        return self.k[:rows], self.v[:rows]


def invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: InvariantPlan,
    scale: float,
    buffers: KeyBuffers | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [N, H, D] (every token of the forward) as planned -> [N, H, D]; ``window``: keys a
    query sees, itself included (0: all); ``softcap``: scores become cap * tanh(s / cap)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    k_all, v_all = (buffers or KeyBuffers()).take(plan.key_rows, k_cache)
    num_slots = k_cache.shape[0]
    k_all.index_copy_(0, plan.kv_rows, k_cache.view(num_slots, -1).index_select(0, plan.kv_slots))
    v_all.index_copy_(0, plan.kv_rows, v_cache.view(num_slots, -1).index_select(0, plan.kv_slots))
    if k_cache.dtype == INT8:  # each row on its own: the same values however rows are batched
        k_all = dequantize_flat(k_all, head_dim, q.dtype)
        v_all = dequantize_flat(v_all, head_dim, q.dtype)
    outs = []
    for g in plan.groups:
        n, q_len, kv_len = g.num_requests, g.q_len, g.kv_len
        keys = slice(g.kv_offset, g.kv_offset + n * kv_len)
        queries = q.index_select(0, g.queries).view(n, q_len, num_kv_heads, group, head_dim)
        attend = _softcapped_attention(softcap) if softcap else F.scaled_dot_product_attention
        out = attend(
            queries.transpose(1, 2).reshape(n, num_kv_heads, q_len * group, head_dim),
            k_all[keys].view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2),
            v_all[keys].view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2),
            attn_mask=g.mask_for(window, group),
            scale=scale,
        )
        out = out.view(n, num_kv_heads, q_len, group, head_dim).transpose(1, 2)
        outs.append(out.reshape(n * q_len, num_heads, head_dim))
    stacked = outs[0] if len(outs) == 1 else torch.cat(outs)
    return stacked.index_select(0, plan.output_rows)


def _softcapped_attention(softcap: float) -> Callable[..., torch.Tensor]:
    """Attention with soft-capped scores, the same call shape as the fused attention."""

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        scores = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
        scores = soft_cap(scores, softcap) + attn_mask
        return torch.matmul(torch.softmax(scores, dim=-1), v.double()).to(q.dtype)

    return attend


class InvariantTorchBackend(StoreThenAttendBackend):
    """The attention backend of deterministic mode (any device torch's attention runs on)."""

    def __init__(self) -> None:
        self.buffers = KeyBuffers()

    def build_metadata(self, batch: ForwardBatch) -> InvariantMetadata:
        return InvariantMetadata(batch)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        assert isinstance(metadata, InvariantMetadata)
        if metadata.plan is None:
            metadata.plan = plan_invariant(metadata.batch, k_cache, q.shape[1], q.dtype)
        return invariant_attention(
            q, k_cache, v_cache, metadata.plan, scale, self.buffers, options.window, options.softcap
        )
