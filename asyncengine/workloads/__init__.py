"""Replayable workloads: seeded generators, arrival processes and JSONL traces."""

from __future__ import annotations

from asyncengine.workloads.arrivals import Arrivals, all_at_once, fixed_interval, poisson
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
from asyncengine.workloads.trace import WorkloadRequest, load_trace, save_trace

__all__ = [
    "WORKLOADS",
    "Arrivals",
    "WorkloadRequest",
    "all_at_once",
    "fixed_interval",
    "load_trace",
    "long_short",
    "make_workload",
    "multi_turn",
    "poisson",
    "pseudo_text",
    "random_lengths",
    "save_trace",
    "shared_prefix",
    "tree_of_thought",
]
