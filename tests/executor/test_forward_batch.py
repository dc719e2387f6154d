"""build_forward_batch against a per-token loop, and the packed device transfer against views."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.forward_batch import _to_device, _vectorized_batch, build_forward_batch

PAGE = 4


def _plan(rng: np.random.Generator, num_ext: int, num_dec: int) -> BatchPlan:
    extends = [
        Segment(f"e{i}", i, rng.integers(0, 1000, int(rng.integers(1, 11))).tolist(),
                int(rng.integers(0, 9)), bool(rng.integers(0, 2)))
        for i in range(num_ext)
    ]  # fmt: skip
    decodes = [
        Segment(f"d{i}", num_ext + i, [int(rng.integers(0, 1000))], int(rng.integers(0, 20)),
                bool(rng.integers(0, 2)))
        for i in range(num_dec)
    ]  # fmt: skip
    return BatchPlan(step=0, extends=extends, decodes=decodes)


@pytest.mark.parametrize(("num_ext", "num_dec"), [(0, 1), (0, 7), (3, 0), (2, 5), (0, 0)])
def test_batch_matches_a_per_token_loop(num_ext: int, num_dec: int) -> None:
    rng = np.random.default_rng(num_ext * 10 + num_dec)
    table = rng.permutation(64 * 8).astype(np.int32).reshape(64, 8)
    plan = _plan(rng, num_ext, num_dec)
    batch = build_forward_batch(plan, table, PAGE, torch.device("cpu"))
    ids, positions, slots, sampled = [], [], [], []
    for seg in [*plan.extends, *plan.decodes]:
        for j, token in enumerate(seg.input_ids):
            pos = seg.start_pos + j
            ids.append(token)
            positions.append(pos)
            slots.append(int(table[seg.row, pos // PAGE]) * PAGE + pos % PAGE)
        if seg.sample:
            sampled.append(len(ids) - 1)
    assert batch.input_ids.tolist() == ids
    assert batch.positions.tolist() == positions
    assert batch.slot_mapping.tolist() == slots
    assert batch.sample_indices.tolist() == sampled
    assert batch.sampled_rows is not None
    assert batch.sampled_rows.tolist() == [s.row for s in plan.segments if s.sample]
    assert batch.deferred_at is None and batch.deferred_rows is None
    assert batch.input_ids.dtype == torch.int64 and batch.extend_seq_lens.dtype == torch.int32
    assert batch.num_extend_tokens == sum(s.num_tokens for s in plan.extends)
    assert batch.decode_seq_lens.tolist() == [s.start_pos + 1 for s in plan.decodes]
    assert batch.extend_seq_lens.tolist() == [s.end_pos for s in plan.extends]
    for block_table, segs in ((batch.decode_block_table, plan.decodes),
                              (batch.extend_block_table, plan.extends)):  # fmt: skip
        width = -(-max((s.end_pos for s in segs), default=0) // PAGE)
        assert block_table.shape == (len(segs), width)
        for row, seg in zip(block_table.tolist(), segs, strict=True):
            assert row == table[seg.row, :width].tolist()


def test_a_decode_of_two_tokens_is_refused() -> None:
    plan = BatchPlan(step=0, decodes=[Segment("d", 0, [1, 2], 3, True)])
    with pytest.raises(ValueError, match="decode segment 'd' has 2 tokens"):
        build_forward_batch(plan, np.zeros((2, 4), np.int32), PAGE, torch.device("cpu"))


def test_packed_transfer_gives_the_same_tensors() -> None:
    rng = np.random.default_rng(0)
    longs = [rng.integers(0, 100, n) for n in (5, 0, 3)]
    ints = [rng.integers(0, 100, (2, 3)).astype(np.int32), np.arange(4, dtype=np.int32)]
    cpu = torch.device("cpu")
    plain = _to_device(longs, ints, cpu, None, packed=False)
    packed = _to_device(longs, ints, cpu, None, packed=True)
    for a, b in zip(plain, packed, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_a_lone_decode_gives_the_vectorized_tensors(seed: int) -> None:
    """The one-stream path (a plan of one decode on a CPU) against the vectorized one: every
    field the same (values, dtypes, shapes), sampled or not, on a page boundary or inside, with
    KV copies; the block table a copy, not a view of the page table."""
    rng = np.random.default_rng(seed)
    table = rng.permutation(64 * 8).astype(np.int32).reshape(64, 8)
    start = [0, 3, 4, 7, 30, 31][seed]
    copies = [(5, 9), (6, 10)] if seed % 2 else []
    plan = BatchPlan(
        step=0,
        decodes=[Segment("d", int(rng.integers(0, 64)), [int(rng.integers(0, 1000))], start,
                         bool(seed % 3))],
        kv_copies=copies,
    )  # fmt: skip
    cpu = torch.device("cpu")
    fast = build_forward_batch(plan, table, PAGE, cpu)
    want = _vectorized_batch(plan, table, PAGE, cpu, None, 0)
    for field in dataclasses.fields(fast):
        a, b = getattr(fast, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), field.name
        elif isinstance(b, tuple):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), field.name
        else:
            assert a == b, field.name
    assert fast.decode_block_table.numpy().base is not table
    table[:] = -1  # later page writes do not reach a batch already built
    assert torch.equal(fast.decode_block_table, want.decode_block_table)
