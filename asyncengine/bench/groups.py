"""Per-group views of a run (by tenant or by priority) and SLO attainment.

A request meets its SLO when it completed, its TTFT is within ``ttft`` and its TPOT (mean time
per output token after the first) within ``tpot`` (a one-token answer has no TPOT and meets
that part). Goodput is the requests that met it per second of the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asyncengine.bench.percentiles import LatencyStats
from asyncengine.bench.records import RequestRecord


@dataclass(frozen=True, slots=True)
class SLO:
    ttft: float | None = None  # seconds
    tpot: float | None = None

    @classmethod
    def parse(cls, items: Sequence[tuple[str, object]]) -> SLO:
        """From ``ttft_ms=..``/``tpot_ms=..`` (``itl_ms`` is taken as ``tpot_ms``)."""
        values: dict[str, float] = {}
        for key, value in items:
            name = {"itl_ms": "tpot_ms"}.get(key, key)
            if name not in ("ttft_ms", "tpot_ms") or not isinstance(value, (int, float)):
                raise ValueError(f"SLO targets are ttft_ms=N and tpot_ms=N, got {key}={value!r}")
            values[name[:-3]] = float(value) / 1e3
        return cls(**values)

    def met(self, record: RequestRecord) -> bool:
        if not record.completed:
            return False
        ttft, tpot = record.ttft, record.tpot
        if self.ttft is not None and (ttft is None or ttft > self.ttft):
            return False
        return self.tpot is None or tpot is None or tpot <= self.tpot

    def attainment(self, records: Sequence[RequestRecord]) -> float:
        return sum(self.met(r) for r in records) / len(records) if records else math.nan

    def goodput(self, records: Sequence[RequestRecord], duration: float) -> float:
        return sum(self.met(r) for r in records) / duration if duration > 0 else math.nan


@dataclass(slots=True)
class GroupSummary:
    group: str
    requests: int
    completed: int
    timed_out: int
    ttft: LatencyStats
    e2e: LatencyStats
    queue_steps: float  # mean steps waited before admission (all block reasons)


def group_key(record: RequestRecord, by: str) -> str:
    if by == "tenant":
        return record.tenant or "-"
    if by == "priority":
        return str(record.priority)
    if by == "lora":
        return record.lora or "-"
    raise ValueError(f"group by 'tenant', 'priority' or 'lora', not {by!r}")


def summarize_groups(records: Sequence[RequestRecord], by: str) -> list[GroupSummary]:
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(group_key(record, by), []).append(record)

    def order(key: str) -> tuple[int, str]:
        return (int(key), "") if by == "priority" else (0, key)

    out = []
    for key in sorted(groups, key=order):
        members = groups[key]
        done = [r for r in members if r.completed]
        out.append(
            GroupSummary(
                group=key,
                requests=len(members),
                completed=len(done),
                timed_out=sum(r.timed_out for r in members),
                ttft=LatencyStats.of([r.ttft for r in done if r.ttft is not None]),
                e2e=LatencyStats.of([r.e2e for r in done if r.e2e is not None]),
                queue_steps=float(np.mean([sum(r.blocked.values()) for r in members])),
            )
        )
    return out
