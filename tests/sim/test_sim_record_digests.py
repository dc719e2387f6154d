"""The simulator gives the records it gave before its speed work, on the same traces.

Digests of every request's record (token times, finish time, cached tokens, admission blocks),
the step count, the virtual time and the scheduler's counters, taken with the simulator of
main at 06a3804 (before the waiting queue, the lazy prompts and the lighter quiet steps), its
prefix-cache hit and miss tokens counting each prompt once, at its first admission, on five
traces that queue hundreds of requests under a small KV pool: fcfs, lpm, sjf, fair (two
tenants) and dfs-weight. Each is checked step by step from a list workload and on the
fast path (bulk decoding, a compact workload, finished requests kept as records only).
Simulated results are pure Python arithmetic on a virtual clock: the same on every machine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.sim import CostModel, Simulator
from asyncengine.workloads import Arrivals, WorkloadRequest, make_workload, random_lengths
from asyncengine.workloads.compact import CompactWorkload
from asyncengine.workloads.scheduling import multi_tenant


def _shared(groups: int, per_group: int, seed: int) -> list[WorkloadRequest]:
    return make_workload(
        "shared_prefix",
        num_groups=groups,
        questions_per_group=per_group,
        arrivals=Arrivals.parse("poisson:6"),
        seed=seed,
    )


def _random(seed: int) -> list[WorkloadRequest]:
    return random_lengths(1500, input_median=80.0, arrivals=Arrivals.parse("poisson:4"), seed=seed)


# policy, trace, digest (of the records, steps, virtual time and scheduler stats) and step count
CASES: dict[str, tuple[str, Callable[[], list[WorkloadRequest]], str, int]] = {
    "fcfs-random": ("fcfs", lambda: _random(3), "655da32b4f7fe175", 6461),
    "lpm-shared": ("lpm", lambda: _shared(12, 100, 3), "6cd4acd3011d5be7", 1399),
    "sjf-random": ("sjf", lambda: _random(4), "8528015b5b17be9e", 5742),
    "fair-tenants": (
        "fair",
        lambda: multi_tenant(num_heavy=600, num_light=300),
        "152653003b2e43dd",  # fair's order at equal counters: fewer requests in the engine first
        5729,
    ),
    "dfs-shared": ("dfs-weight", lambda: _shared(20, 50, 5), "d2f547d457a8ecfd", 1309),
}


def _digest(config: EngineConfig, workload: object, bulk: bool) -> tuple[str, int]:
    result = Simulator(config, CostModel.default(), bulk_decode=bulk).run(workload)  # type: ignore[arg-type]
    # a record's adapter came after the digests: the base model's (None) leaves them as they
    # were; so did its queue time, which only reads the first scheduled time
    records = [
        {
            k: v
            for k, v in asdict(record).items()
            if (k != "lora" or v is not None) and k != "queue_time"
        }
        for record in result.records
    ]
    # so did the counts of failed policy hooks, of the policy's idle holds and of admissions
    # refused after their open while they are 0
    later = ("policy_failures", "policy_idle_holds", "policy_idle_seconds", "failed_admissions")
    # and the prompt tokens the forwards computed, counted after them (computed_tokens holds them)
    stats = {
        k: v
        for k, v in result.scheduler_stats.items()
        if (k not in later or v != 0) and k != "prefill_computed_tokens"
    }
    blob = json.dumps(
        [records, result.steps, result.virtual_seconds, stats],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16], result.steps


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.usefixtures("quiet_scheduler")
def test_simulator_gives_the_records_it_gave_before(case: str) -> None:
    policy, make, digest, steps = CASES[case]
    workload = make()
    # the digests were taken before short prompts joined the steps of a prompt mid-chunk
    config = EngineConfig(
        policy=policy, kv_cache_tokens=8192, max_queue_time=300.0, short_prompt_tokens=0
    )
    assert _digest(config, workload, bulk=False) == (digest, steps)
    assert _digest(config, CompactWorkload.from_requests(workload), bulk=True) == (digest, steps)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fair-tenants", "lpm-shared"])
@pytest.mark.usefixtures("quiet_scheduler")
def test_the_fast_path_gives_the_step_by_step_records_with_the_short_prompt_lane(
    case: str,
) -> None:
    policy, make, _, _ = CASES[case]
    workload = make()
    config = EngineConfig(policy=policy, kv_cache_tokens=8192, max_queue_time=300.0)
    assert config.short_prompt_tokens > 0
    step_by_step = _digest(config, workload, bulk=False)
    assert _digest(config, CompactWorkload.from_requests(workload), bulk=True) == step_by_step
