"""How the torch attention groups requests (extend buckets, decode chunks), and a ragged forward
of the model through those groups against each request alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.attention.torch_backend import TorchBackend
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.attention_grouping import (
    ExtendCost,
    bucket_cost,
    decode_chunks,
    extend_buckets,
    extend_cost_for,
)
from asyncengine.kernels.reference import decode_sparse_ref
from tests.conftest import TinyCheckpoint
from tests.paged_pool_support import nan_pool, shuffled_page_table

COST = extend_cost_for(num_heads=9, num_kv_heads=3, head_dim=64)
SINGLE = ExtendCost(pair=1.0, key=1.0, call=float("inf"))


def total_cost(buckets: list[list[int]], q_lens: list[int], kv_lens: list[int]) -> float:
    return sum(
        bucket_cost(COST, len(b), max(q_lens[i] for i in b), max(kv_lens[i] for i in b))
        for b in buckets
    )


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 600), st.integers(0, 600)), min_size=1, max_size=40))
def test_extend_buckets_partition_the_requests_no_worse_than_one_or_each_alone(
    lens: list[tuple[int, int]],
) -> None:
    q_lens = [q for q, _ in lens]
    kv_lens = [q + prefix for q, prefix in lens]
    buckets = extend_buckets(q_lens, kv_lens, COST)
    assert sorted(i for b in buckets for i in b) == list(range(len(lens)))
    assert all(b == sorted(b) for b in buckets)  # token order kept inside a bucket
    chosen = total_cost(buckets, q_lens, kv_lens)
    assert chosen <= total_cost([list(range(len(lens)))], q_lens, kv_lens) * (1 + 1e-9)
    assert chosen <= total_cost([[i] for i in range(len(lens))], q_lens, kv_lens) * (1 + 1e-9)


def test_uniform_prompts_stay_one_call() -> None:
    assert extend_buckets([96] * 32, [96] * 32, COST) == [list(range(32))]


def test_ragged_prompts_split_by_length() -> None:
    q_lens = [20, 280, 22, 280, 18, 21, 280, 19]
    buckets = extend_buckets(q_lens, q_lens, COST)
    assert sorted(map(sorted, buckets)) == [[0, 2, 4, 5, 7], [1, 3, 6]]


def test_an_infinite_call_price_keeps_one_bucket() -> None:
    assert extend_buckets([3, 500, 7], [3, 900, 7], SINGLE) == [[0, 1, 2]]


@settings(max_examples=60, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    max_keys=st.integers(1, 2000),
)
def test_decode_chunks_are_longest_first_within_the_key_budget(
    seq_lens: list[int], max_keys: int
) -> None:
    chunks = decode_chunks(seq_lens, max_keys)
    assert sorted(i for c in chunks for i in c) == list(range(len(seq_lens)))
    order = [seq_lens[i] for c in chunks for i in c]
    assert order == sorted(order, reverse=True)
    for chunk in chunks:
        longest = seq_lens[chunk[0]]
        assert len(chunk) == 1 or len(chunk) * longest <= max_keys


class Runner:
    """A runner over a NaN-filled pool whose pages are handed out shuffled."""

    def __init__(self, ckpt: TinyCheckpoint, page_size: int, backend: TorchBackend) -> None:
        config = ModelConfig.from_hf_dict(ckpt.hf_config)
        table, num_pages = shuffled_page_table(8, 256, page_size, seed=page_size)
        pool = nan_pool(config, num_pages, page_size)
        self.runner = ModelRunner(config, ckpt.load_weights(), pool, table, torch.float32)
        self.runner.backend = backend
        self.vocab = config.vocab_size


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "backend",
    [TorchBackend(native=False), TorchBackend(SINGLE, native=False), TorchBackend()],
    ids=["buckets", "one-bucket", "native"],
)
def test_ragged_forward_equals_each_request_alone(
    tiny_llama: TinyCheckpoint,
    page_size: int,
    backend: TorchBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step 1 caches prefixes (ending mid-page) for some requests; step 2 runs very different
    extend lengths on top of them beside decodes of several lengths, in chunks of two (4 heads:
    120 keys a chunk, so kv lengths 58 and 41 go together, then 34 and 10)."""
    monkeypatch.setattr(decode_sparse_ref, "SPARSE_DECODE_CHUNK_ENTRIES", 4 * 120)
    h = Runner(tiny_llama, page_size, backend)
    rng = np.random.default_rng(0)
    prefixes = [0, 5, 0, 17, 33, 40, 9, 57]
    new = [3, 120, 7, 60, 1, 1, 1, 1]  # the last four as decodes
    tokens = [rng.integers(3, h.vocab, p + n).tolist() for p, n in zip(prefixes, new, strict=True)]
    cached = [Segment(f"r{i}", i, t[: prefixes[i]], 0, False) for i, t in enumerate(tokens)]
    h.runner.forward_logits(BatchPlan(step=1, extends=[s for s in cached if s.num_tokens]))
    segments = [
        Segment(f"r{i}", i, t[prefixes[i] :], prefixes[i], True) for i, t in enumerate(tokens)
    ]
    both = h.runner.forward_logits(BatchPlan(step=2, extends=segments[:4], decodes=segments[4:]))
    for i, segment in enumerate(segments):
        alone = BatchPlan(
            step=3, extends=[segment] if i < 4 else [], decodes=[segment] if i >= 4 else []
        )
        torch.testing.assert_close(both[i], h.runner.forward_logits(alone)[0], rtol=0, atol=2e-5)
