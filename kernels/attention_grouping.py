"""Which requests the torch attention runs together: extend buckets and decode chunks.

Attention over padded tensors costs in proportion to the padded grid, so requests of very
different lengths in one call pay for the longest. Extends are split into buckets of similar
lengths by dynamic programming over a cost estimate (padded work + a fixed price per call):
a uniform batch stays one call, a ragged one is cut where the padding costs more than a call.
Decodes are walked longest first in chunks whose gathered K/V fit a byte budget, each chunk
padded to its own longest request only.

Pure index arithmetic on host lists: no tensors, so it is tested and reasoned about alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ExtendCost:
    """Seconds-like prices of one extend call (only their ratios matter).

    ``pair`` per (query, key) pair of the padded grid, ``key`` per gathered key row, ``call``
    per call (the gather, query copy, attention and output copy each dispatch a few ops).
    """

    pair: float
    key: float
    call: float


def extend_cost_for(num_heads: int, num_kv_heads: int, head_dim: int) -> ExtendCost:
    """Prices fitted on a 1-thread AVX2 CPU by ``scripts/fit_extend_cost.py`` (SmolLM2-135M's
    9 x 64 query and 3 x 64 KV heads: 38 ns a pair, 0.3 us a key, 67 us a call), scaled by the
    head sizes: attention work grows with query heads x head_dim, the gather with KV heads."""
    return ExtendCost(
        pair=num_heads * head_dim * 66e-12,
        key=2 * num_kv_heads * head_dim * 0.8e-9,
        call=67e-6,
    )


def bucket_cost(cost: ExtendCost, num_requests: int, q_len: int, kv_len: int) -> float:
    return num_requests * kv_len * (q_len * cost.pair + cost.key) + cost.call


def extend_buckets(q_lens: list[int], kv_lens: list[int], cost: ExtendCost) -> list[list[int]]:
    """Requests (indices) grouped into buckets that minimize the summed ``bucket_cost``.

    Requests are ordered by kv length (then query length) and cut into contiguous runs of that
    order; the best cut is found exactly by dynamic programming, O(n^2) vectorized.
    """
    count = len(q_lens)
    if count <= 1:
        return [list(range(count))]
    order = np.lexsort((np.asarray(q_lens), np.asarray(kv_lens)))
    q_sorted = np.asarray(q_lens, dtype=np.float64)[order]
    kv_sorted = np.asarray(kv_lens, dtype=np.float64)[order]
    best = np.zeros(count + 1)
    cut = np.zeros(count + 1, dtype=np.int64)
    for end in range(1, count + 1):
        starts = np.arange(end)
        # longest query of requests start..end-1, for every start
        q_max = np.maximum.accumulate(q_sorted[:end][::-1])[::-1]
        kv_max = kv_sorted[end - 1]  # ascending order: the last is the longest
        totals = best[:end] + (end - starts) * kv_max * (q_max * cost.pair + cost.key)
        start = int(np.argmin(totals))
        best[end] = totals[start] + cost.call
        cut[end] = start
    buckets: list[list[int]] = []
    end = count
    while end > 0:
        start = int(cut[end])
        buckets.append(sorted(order[start:end].tolist()))
        end = start
    return buckets[::-1]


def decode_chunks(seq_lens: list[int], max_keys: int) -> list[list[int]]:
    """Requests (indices) longest first, in chunks of at most ``max_keys`` padded keys
    (chunk size x its longest request), at least one request each."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    chunks: list[list[int]] = []
    for index in order:
        if chunks and (len(chunks[-1]) + 1) * seq_lens[chunks[-1][0]] <= max_keys:
            chunks[-1].append(index)
        else:
            chunks.append([index])
    return chunks
