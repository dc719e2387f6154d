"""Replayable workloads: seeded generators, arrival processes and JSONL traces."""

from __future__ import annotations

from asyncengine.workloads.adapters import ADAPTER_WORKLOADS, adapter_mix, hot_adapter_flood
from asyncengine.workloads.arrivals import Arrivals, all_at_once, fixed_interval, poisson
from asyncengine.workloads.eviction import EVICTION_WORKLOADS, hot_scan
from asyncengine.workloads.generators import (
    WORKLOADS,
    long_short,
    make_workload,
    multi_turn,
    pseudo_text,
    random_lengths,
    shared_prefix,
    tree_of_thought,
)
from asyncengine.workloads.scheduling import (
    SCHEDULING_WORKLOADS,
    multi_tenant,
    priority_mix,
    slo_mix,
)
from asyncengine.workloads.trace import WorkloadRequest, load_trace, save_trace

WORKLOADS.update(SCHEDULING_WORKLOADS)
WORKLOADS.update(ADAPTER_WORKLOADS)
WORKLOADS.update(EVICTION_WORKLOADS)

__all__ = [
    "WORKLOADS",
    "Arrivals",
    "WorkloadRequest",
    "adapter_mix",
    "all_at_once",
    "fixed_interval",
    "hot_adapter_flood",
    "hot_scan",
    "load_trace",
    "long_short",
    "make_workload",
    "multi_tenant",
    "multi_turn",
    "poisson",
    "priority_mix",
    "pseudo_text",
    "random_lengths",
    "save_trace",
    "shared_prefix",
    "slo_mix",
    "tree_of_thought",
]
