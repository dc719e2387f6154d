"""Seeded workloads of many LoRA adapters over one base model.

- ``adapter_mix``: Poisson arrivals; each request's adapter drawn from a Zipf popularity over
  ``num_adapters`` adapters ("lora-0" the most popular), a ``base_share`` of requests on the
  base model.
- ``hot_adapter_flood``: one adapter ("hot") floods the engine with more than it serves, while
  ``num_cold`` others ("cold-0", ...) send a few requests each, now and then. With
  ``include_hot=False`` the same cold requests come alone: the baseline their latency under
  the flood is compared with (sim/lora_fairness.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from asyncengine.workloads.arrivals import Arrivals
from asyncengine.workloads.generators import _lognormal_lengths, _tokens
from asyncengine.workloads.trace import WorkloadRequest

_SALT = 0x10FA
HOT_ADAPTER = "hot"


def zipf_shares(num_adapters: int, exponent: float) -> np.ndarray:
    """Popularity of adapter i (from 0) proportional to 1 / (i + 1) ** exponent."""
    if num_adapters < 1:
        raise ValueError("num_adapters must be >= 1")
    if exponent < 0:
        raise ValueError("the Zipf exponent must be >= 0")
    weights = 1.0 / np.arange(1, num_adapters + 1, dtype=np.float64) ** exponent
    return weights / weights.sum()


def adapter_mix(
    num_requests: int = 1000,
    *,
    num_adapters: int = 8,
    zipf_exponent: float = 1.0,
    base_share: float = 0.0,
    rate: float = 4.0,
    vocab_size: int = 32000,
    input_median: float = 180.0,
    output_median: float = 64.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Poisson at ``rate``; adapter ``lora-i`` with Zipf probability, or the base model with
    probability ``base_share``; lognormal prompt and output lengths."""
    if not 0 <= base_share <= 1:
        raise ValueError(f"base_share must be in [0, 1], got {base_share}")
    rng = np.random.default_rng(seed)
    shares = zipf_shares(num_adapters, zipf_exponent)
    times = Arrivals("poisson", rate=rate).times(num_requests, seed ^ _SALT)
    adapters = rng.choice(num_adapters, size=num_requests, p=shares).tolist()
    on_base = (rng.random(num_requests) < base_share).tolist()
    prompts = _lognormal_lengths(rng, num_requests, input_median, 0.6, 4, 4096)
    outputs = _lognormal_lengths(rng, num_requests, output_median, 0.6, 1, 1024)
    return [
        WorkloadRequest(
            f"mix-{i:05d}",
            times[i],
            _tokens(rng, prompts[i], vocab_size),
            outputs[i],
            lora=None if on_base[i] else f"lora-{adapters[i]}",
        )
        for i in range(num_requests)
    ]


def hot_adapter_flood(
    num_hot: int = 600,
    *,
    num_cold: int = 7,
    per_cold: int = 24,
    hot_rate: float = 12.0,
    cold_rate: float = 0.2,
    vocab_size: int = 32000,
    input_median: float = 128.0,
    output_median: float = 32.0,
    include_hot: bool = True,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Adapter "hot" sends ``num_hot`` requests at ``hot_rate`` req/s (more than the engine
    serves); each of ``num_cold`` adapters ``cold-j`` sends ``per_cold`` at ``cold_rate``,
    all Poisson, by arrival time. The cold requests are the same with or without the hot ones
    (``include_hot``)."""
    rng = np.random.default_rng(seed)
    groups = [(f"cold-{j}", per_cold, cold_rate) for j in range(num_cold)]
    groups.append((HOT_ADAPTER, num_hot, hot_rate))  # drawn last: the cold ones do not move
    items: list[WorkloadRequest] = []
    for index, (adapter, n, rate) in enumerate(groups):
        times = Arrivals("poisson", rate=rate).times(n, seed ^ _SALT ^ (index + 1))
        phase = float(rng.uniform(0.0, 1.0 / rate))  # the adapters do not all start at 0
        times = [t + phase for t in times]
        lengths = _lognormal_lengths(rng, n, input_median, 0.4, 4, 2048)
        outputs = _lognormal_lengths(rng, n, output_median, 0.6, 1, 512)
        prompts = [_tokens(rng, length, vocab_size) for length in lengths]
        if adapter == HOT_ADAPTER and not include_hot:
            continue
        for i, (t, prompt, out) in enumerate(zip(times, prompts, outputs, strict=True)):
            items.append(WorkloadRequest(f"{adapter}-{i:04d}", t, prompt, out, lora=adapter))
    items.sort(key=lambda w: (w.arrival_time, w.rid))
    return items


ADAPTER_WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "adapter_mix": adapter_mix,
    "hot_adapter_flood": hot_adapter_flood,
}
