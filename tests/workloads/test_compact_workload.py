"""A workload held as arrays (workloads/compact.py) is the same workload, and simulates the same.

``random_compact`` draws ``random_lengths``'s requests; ``from_requests`` and ``by_arrival``
keep every field; the simulator fed a compact workload, with finished requests kept as records
only (``WorkloadReplay(keep_requests=False)``) and its fast paths on (bulk decoding, quiet
steps, LPM's all-miss order), gives every request the record the plain path gives a list of
the same requests step by step: token times (so TTFT and every gap), finish time, cached
tokens, admission blocks.
"""

from __future__ import annotations

import random
from dataclasses import asdict, replace

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.sim import CostModel, Simulator, WorkloadReplay
from asyncengine.sim import workload_replay as replay_module
from asyncengine.workloads import Arrivals, WorkloadRequest, multi_tenant, random_lengths
from asyncengine.workloads.compact import CompactWorkload, random_compact

POISSON_3 = Arrivals.parse("poisson:3")


pytestmark = pytest.mark.usefixtures("quiet_scheduler")


@pytest.mark.parametrize("seed", [0, 5])
def test_random_compact_draws_random_lengths_requests(seed: int) -> None:
    options = {"input_median": 60.0, "max_output_len": 200, "arrivals": POISSON_3, "seed": seed}
    compact = random_compact(300, **options)  # type: ignore[arg-type]
    assert len(compact) == 300
    assert list(compact) == random_lengths(300, **options)  # type: ignore[arg-type]
    assert compact[-1] == compact[299] and compact[2:4] == [compact[2], compact[3]]


def _controls_shuffled() -> list[WorkloadRequest]:
    """Tenants, priorities, timeouts, and arrivals out of list order (ties included)."""
    rng = random.Random(1)
    items = multi_tenant(num_heavy=60, num_light=30)
    items = [
        replace(
            item,
            priority=i % 3,
            timeout=None if i % 4 else 30.0 + i,
            arrival_time=round(item.arrival_time, 0),
        )
        for i, item in enumerate(items)
    ]
    rng.shuffle(items)
    return items


def test_from_requests_keeps_every_field_and_by_arrival_sorts_stably() -> None:
    items = _controls_shuffled()
    compact = CompactWorkload.from_requests(items)
    assert list(compact) == items
    ordered = compact.by_arrival()
    assert list(ordered) == sorted(items, key=lambda w: w.arrival_time)
    assert ordered.by_arrival() is ordered
    with pytest.raises(ValueError, match="prompt text"):
        CompactWorkload.from_requests([replace(items[0], prompt_text="hi")])


def _records(config: EngineConfig, workload: object, bulk: bool) -> tuple[list[dict], int, float]:
    sim = Simulator(config, CostModel.default(), bulk_decode=bulk)
    result = sim.run(workload)  # type: ignore[arg-type]
    return [asdict(r) for r in result.records], result.steps, result.virtual_seconds


@pytest.mark.parametrize(
    ("policy", "workload"),
    [
        ("fcfs", "random"),
        ("lpm", "random"),
        ("sjf", "random"),
        ("fcfs", "controls"),
        ("lpm", "controls"),
    ],
)
def test_compact_fast_path_gives_the_plain_step_by_step_records(
    policy: str, workload: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replay_module, "_FIRST_SWEEP", 16)  # finished ones let go early
    if workload == "random":
        items = random_lengths(400, input_median=80.0, arrivals=POISSON_3, seed=2)
    else:
        items = _controls_shuffled()
    config = EngineConfig(policy=policy, kv_cache_tokens=6144, max_queue_time=120.0)
    plain = _records(config, items, bulk=False)
    fast = _records(config, CompactWorkload.from_requests(items), bulk=True)
    assert fast == plain
    assert any(r["token_times"] for r in plain[0])  # the case ran requests


def test_finished_requests_are_kept_as_records_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay_module, "_FIRST_SWEEP", 16)
    workload = random_compact(300, input_median=60.0, arrivals=POISSON_3, seed=4)
    kept: list[tuple[int, int]] = []
    sims = []
    for keep in (True, False):
        sim = Simulator(EngineConfig(), CostModel.default())
        replay = WorkloadReplay(sim.core, sim.clock, workload, bulk=sim.bulk, keep_requests=keep)
        while not replay.done():
            if not replay._bulk_step() and replay.step() is None:
                break
        assert sim.bulk is not None
        sim.bulk.flush()
        # every request is held as a request or, once let go, as its record: never both
        assert set(replay.requests).isdisjoint(replay.finished_records)
        kept.append((len(replay.requests), len(replay.finished_records)))
        sims.append([asdict(r) for r in replay.records()])
    assert sims[0] == sims[1]
    assert kept[0] == (300, 0)
    assert sum(kept[1]) == 300 and kept[1][1] >= 100, kept
