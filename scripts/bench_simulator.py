#!/usr/bin/env python
"""How long the simulator takes to simulate N requests, per policy: a table and a JSON file.

    python scripts/bench_simulator.py --num-requests 50000 --policies fcfs lpm dfs-weight \
        --arrivals poisson:2 --out /tmp/bench_sim.json

The workload is a seeded generator (default ``random``: ShareGPT-like lengths, nothing shared)
with the given arrivals (``--compact``: the same random requests held as arrays, which a
million-request run needs to fit in memory); ``poisson:2`` is about twice what the default cost model serves, so
the waiting queue grows through the run (the overload case). Each policy runs ``--repeats``
times on a fresh simulator; the table gives the median CPU and wall seconds of ``run`` (the
workload is generated once, outside the timing). The last line says whether the scheduler, KV
cache and step loop ran compiled (mypyc, ``make setup``) or interpreted.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import resource
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.common.config import EngineConfig
from asyncengine.compiled import core_kind, edited_since_build
from asyncengine.script_main import run_main
from asyncengine.sim import CostModel, simulate
from asyncengine.workloads import Arrivals, WorkloadRequest, make_workload
from asyncengine.workloads.compact import random_compact


@dataclass(slots=True)
class PolicyTiming:
    policy: str
    cpu_seconds: list[float]
    wall_seconds: list[float]
    steps: int
    virtual_seconds: float
    completed: int
    cache_hit_rate: float

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu_seconds)

    @property
    def median_wall(self) -> float:
        return statistics.median(self.wall_seconds)


def time_policy(
    policy: str,
    base: EngineConfig,
    workload: Sequence[WorkloadRequest],
    cost: CostModel,
    repeats: int,
    bulk_decode: bool = True,
) -> PolicyTiming:
    runs = [
        simulate(base.replace(policy=policy), workload, cost, bulk_decode=bulk_decode)
        for _ in range(repeats)
    ]
    result = runs[-1]
    return PolicyTiming(
        policy=policy,
        cpu_seconds=[run.cpu_seconds for run in runs],
        wall_seconds=[run.wall_seconds for run in runs],
        steps=result.steps,
        virtual_seconds=result.virtual_seconds,
        completed=result.summary.num_completed,
        cache_hit_rate=result.summary.cache_hit_rate,
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Sequence[str] | None = None) -> list[PolicyTiming]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=50_000)
    parser.add_argument("--policies", nargs="+", default=["fcfs", "lpm", "dfs-weight"])
    parser.add_argument("--workload", default="random", help="generator name")
    parser.add_argument("--arrivals", default="poisson:2", help="burst | poisson:RATE | ...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per policy (median)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON file for the timings")
    parser.add_argument(
        "--compact",
        action="store_true",
        help="hold the workload as arrays (workloads/compact.py: the random mix, the same "
        "requests), for runs of a million requests",
    )
    parser.add_argument(
        "--step-by-step",
        action="store_true",
        help="write every decode of every step (no bulk decoding: sim/bulk_decode.py)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1:
        parser.error("--repeats and --num-requests must be >= 1")

    logging.getLogger("asyncengine.scheduler.scheduler").setLevel(logging.ERROR)  # retract notes
    arrivals = Arrivals.parse(args.arrivals)
    workload: Sequence[WorkloadRequest]
    if args.compact:
        if args.workload != "random":
            parser.error("--compact makes the random mix only")
        workload = random_compact(args.num_requests, arrivals=arrivals, seed=args.seed)
    else:
        workload = make_workload(
            args.workload, num_requests=args.num_requests, arrivals=arrivals, seed=args.seed
        )
    base = EngineConfig(kv_cache_tokens=args.kv_cache_tokens)
    cost = CostModel.default()
    timings = []
    print(f"{'policy':<16} {'cpu s':>8} {'wall s':>8} {'steps':>8} {'done':>7} {'hit':>6}")
    for policy in args.policies:
        timing = time_policy(
            policy, base, workload, cost, args.repeats, bulk_decode=not args.step_by_step
        )
        timings.append(timing)
        print(
            f"{policy:<16} {timing.median_cpu:8.2f} {timing.median_wall:8.2f} {timing.steps:8d} "
            f"{timing.completed:7d} {timing.cache_hit_rate:6.3f}",
            flush=True,
        )
    core = core_kind()  # mypyc's build (make setup) or the .py files: scripts/build_native.py
    edited = edited_since_build()  # then the whole core runs interpreted until make setup
    print(
        f"peak RSS {peak_rss_mb():.0f} MB; core {core}"
        + (f" (edited since the build: {', '.join(edited)})" if edited else "")
    )
    if args.out:
        report = {
            "num_requests": args.num_requests,
            "workload": args.workload,
            "arrivals": args.arrivals,
            "seed": args.seed,
            "bulk_decode": not args.step_by_step,
            "compact": args.compact,
            "peak_rss_mb": peak_rss_mb(),
            "core": core,
            "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(),
            "timings": [
                {**asdict(t), "median_cpu": t.median_cpu, "median_wall": t.median_wall}
                for t in timings
            ],
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return timings


if __name__ == "__main__":
    run_main(main)
