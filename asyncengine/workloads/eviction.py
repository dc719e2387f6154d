"""A workload where least-recently-used eviction is known to fail: a hot system prompt between
scans of one-off prompts.

Every ``hot_every``-th request is the hot system prompt plus a short question; the others are
long prompts seen once. When the one-off prompts between two hot requests fill more than the
pool, LRU evicts the hot prompt every time (it was used longest ago), while a rule that counts
uses (lfu, arc) or knows the queue keeps it: the classic scan that LRU loses."""

from __future__ import annotations

import numpy as np

from asyncengine.workloads.arrivals import Arrivals
from asyncengine.workloads.generators import _assemble, _lognormal_lengths, _tokens
from asyncengine.workloads.trace import WorkloadRequest


def hot_scan(
    num_requests: int = 400,
    *,
    hot_every: int = 4,
    vocab_size: int = 32000,
    system_len: int = 1024,
    question_median: float = 32.0,
    scan_median: float = 1024.0,
    max_scan_len: int = 4096,
    output_len: int = 16,
    arrivals: Arrivals | None = None,
    seed: int = 0,
    text: bool = False,
) -> list[WorkloadRequest]:
    """``num_requests`` prompts: one in ``hot_every`` is the hot system prompt + a question,
    the rest one-off prompts of lognormal length around ``scan_median``."""
    if hot_every < 1:
        raise ValueError(f"hot_every must be >= 1, got {hot_every}")
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_len, vocab_size)
    questions = _lognormal_lengths(rng, num_requests, question_median, 0.5, 1, 512)
    scans = _lognormal_lengths(rng, num_requests, scan_median, 0.5, 16, max_scan_len)
    prompts = [
        system + _tokens(rng, questions[i], vocab_size)
        if i % hot_every == 0
        else _tokens(rng, scans[i], vocab_size)
        for i in range(num_requests)
    ]
    return _assemble(
        "hotscan", prompts, [output_len] * num_requests, arrivals or Arrivals(), seed, text
    )


EVICTION_WORKLOADS = {"hot_scan": hot_scan}
