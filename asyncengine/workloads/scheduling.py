"""Seeded workloads for the scheduling controls: tenants, priorities, latency targets.

- ``multi_tenant``: one heavy tenant sending long prompts fast and one light tenant sending
  short ones now and then, both Poisson; together more than the engine serves.
- ``priority_mix``: independent prompts, Poisson; a share of them interactive (priority 0,
  short answers), the rest batch (priority 1, long answers).
- ``slo_mix``: chat-sized prompts with a share of long documents among them, Poisson near the
  engine's capacity: long prefills are what break ITL targets, queues what break TTFT ones.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from asyncengine.workloads.arrivals import Arrivals
from asyncengine.workloads.generators import _lognormal_lengths, _tokens
from asyncengine.workloads.trace import WorkloadRequest

_SALT = 0x7E4A


def multi_tenant(
    num_heavy: int = 300,
    num_light: int = 30,
    *,
    heavy_rate: float = 3.0,
    light_rate: float = 0.3,
    vocab_size: int = 32000,
    heavy_input_median: float = 600.0,
    light_input_median: float = 60.0,
    heavy_output: int = 64,
    light_output: int = 32,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Tenant "heavy" (long prompts, ``heavy_rate`` req/s) and tenant "light" (short prompts,
    ``light_rate`` req/s), interleaved by arrival time."""
    rng = np.random.default_rng(seed)
    items: list[WorkloadRequest] = []
    for tenant, n, rate, median, out in (
        ("heavy", num_heavy, heavy_rate, heavy_input_median, heavy_output),
        ("light", num_light, light_rate, light_input_median, light_output),
    ):
        times = Arrivals("poisson", rate=rate).times(n, seed ^ _SALT ^ len(tenant))
        lengths = _lognormal_lengths(rng, n, median, 0.5, 4, 4096)
        for i, (t, length) in enumerate(zip(times, lengths, strict=True)):
            items.append(
                WorkloadRequest(
                    f"{tenant}-{i:04d}", t, _tokens(rng, length, vocab_size), out, tenant=tenant
                )
            )
    items.sort(key=lambda w: (w.arrival_time, w.rid))
    return items


def priority_mix(
    num_requests: int = 400,
    *,
    interactive_share: float = 0.2,
    rate: float = 2.0,
    vocab_size: int = 32000,
    input_median: float = 200.0,
    interactive_output: int = 16,
    batch_output: int = 128,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Poisson arrivals at ``rate``; each request interactive (priority 0) with probability
    ``interactive_share``, else batch (priority 1)."""
    if not 0 <= interactive_share <= 1:
        raise ValueError(f"interactive_share must be in [0, 1], got {interactive_share}")
    rng = np.random.default_rng(seed)
    times = Arrivals("poisson", rate=rate).times(num_requests, seed ^ _SALT)
    lengths = _lognormal_lengths(rng, num_requests, input_median, 0.8, 4, 4096)
    interactive = rng.random(num_requests) < interactive_share
    return [
        WorkloadRequest(
            f"{'ia' if fast else 'batch'}-{i:04d}",
            times[i],
            _tokens(rng, lengths[i], vocab_size),
            interactive_output if fast else batch_output,
            priority=0 if fast else 1,
        )
        for i, fast in enumerate(interactive.tolist())
    ]


def slo_mix(
    num_requests: int = 400,
    *,
    long_share: float = 0.1,
    rate: float = 1.5,
    vocab_size: int = 32000,
    chat_median: float = 120.0,
    long_median: float = 2500.0,
    output_median: float = 96.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Chat prompts (lognormal around ``chat_median``) with ``long_share`` long documents
    (around ``long_median``), Poisson at ``rate``."""
    rng = np.random.default_rng(seed)
    times = Arrivals("poisson", rate=rate).times(num_requests, seed ^ _SALT)
    is_long = rng.random(num_requests) < long_share
    chat = _lognormal_lengths(rng, num_requests, chat_median, 0.6, 4, 1024)
    docs = _lognormal_lengths(rng, num_requests, long_median, 0.3, 512, 6000)
    outputs = _lognormal_lengths(rng, num_requests, output_median, 0.6, 4, 512)
    return [
        WorkloadRequest(
            f"{'doc' if long else 'chat'}-{i:04d}",
            times[i],
            _tokens(rng, docs[i] if long else chat[i], vocab_size),
            outputs[i],
        )
        for i, long in enumerate(is_long.tolist())
    ]


SCHEDULING_WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "multi_tenant": multi_tenant,
    "priority_mix": priority_mix,
    "slo_mix": slo_mix,
}
