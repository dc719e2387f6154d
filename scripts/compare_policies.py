#!/usr/bin/env python
"""Compare engine configurations (policies) on one workload: a markdown table and figures.

    python scripts/compare_policies.py --configs configs/fcfs.toml configs/lpm.toml \
        --workload shared_prefix --arrivals poisson:20 --sim --out results/prefix
    python scripts/compare_policies.py --policies fcfs lpm dfs-weight --workload trace.jsonl --out DIR

    python scripts/compare_policies.py --policies lpm --workload shared_prefix \
        --sweep replicas=1,2 router=cache-aware,round-robin --ray --out results/routers

``--workload`` is a generator name (see asyncengine.workloads.WORKLOADS; its arguments go in
``--workload-arg key=value``) or a JSONL trace. ``--sim`` (the default) drives the real
scheduler with a cost model on a virtual clock; ``--real`` runs the model. DIR receives
results.md, summary.json, workload.jsonl, ttft_cdf.png, itl_p99.png and hit_rate.png.

``--sweep KEY=V1,V2,...`` (repeatable) runs every configuration at every point of the grid;
KEY is an engine config key, or ``replicas``/``router`` for the simulator's multi-replica mode
(N simulated engines behind one of the Ray deployment's routers; ``--replicas``/``--router``
set them for every run). ``--ray [ADDR]`` runs the simulations as Ray tasks, on a local Ray
(no ADDR) or a cluster (ADDR, e.g. ``auto``); the results are the same as a local run's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.bench.records import BenchSummary, RequestRecord, summarize
from asyncengine.bench.report import RunReport, markdown_table, write_figures
from asyncengine.config import EngineConfig, key_value
from asyncengine.sim.sweep import JOB_KEYS, SimJob, expand, parse_sweep, run_jobs
from asyncengine.workloads import Arrivals, load_trace, make_workload, save_trace
from asyncengine.workloads.trace import WorkloadRequest


def load_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    extra = dict(args.workload_arg)
    if args.workload.endswith(".jsonl") or Path(args.workload).is_file():
        if extra or args.arrivals:
            raise SystemExit(
                "--workload-arg and --arrivals apply to generated workloads, not traces"
            )
        return load_trace(args.workload)
    if args.arrivals:
        extra["arrivals"] = Arrivals.parse(args.arrivals)
    return make_workload(args.workload, seed=args.seed, **extra)


def build_configs(args: argparse.Namespace) -> list[tuple[str, EngineConfig]]:
    overrides = dict(args.set)
    configs: list[tuple[str, EngineConfig]] = []
    for path in args.configs:
        configs.append((Path(path).stem, EngineConfig.from_toml(path, **overrides)))
    for policy in args.policies:
        configs.append(
            (policy, EngineConfig.from_toml(args.base_config, policy=policy, **overrides))
        )
    if not configs:
        raise SystemExit("give --configs and/or --policies")
    seen: dict[str, int] = {}
    labelled = []
    for label, config in configs:
        seen[label] = seen.get(label, 0) + 1
        labelled.append((label if seen[label] == 1 else f"{label}#{seen[label]}", config))
    return labelled


def run_one(
    config: EngineConfig, workload: list[WorkloadRequest], args: argparse.Namespace
) -> tuple[list[RequestRecord], BenchSummary, dict[str, Any]]:
    """Run one configuration on the real engine; its records, their summary and its stats."""
    from asyncengine.sim.engine_replay import replay_real

    records, stats = asyncio.run(replay_real(config, workload))
    retracts = stats.get("retractions")
    summary = summarize(records, retracts=None if retracts is None else int(retracts))  # type: ignore[call-overload]
    return records, summary, {"engine_stats": stats}


def main(argv: Sequence[str] | None = None) -> list[RunReport]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="*", default=[], help="engine config TOML files")
    parser.add_argument("--policies", nargs="*", default=[], help="policy specs over --base-config")
    parser.add_argument(
        "--base-config", default=None, help="TOML the --policies entries start from"
    )
    parser.add_argument(
        "--set",
        nargs="*",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="override every config",
    )
    parser.add_argument("--workload", required=True, help="generator name or trace.jsonl")
    parser.add_argument(
        "--workload-arg", nargs="*", type=key_value, default=[], metavar="KEY=VALUE"
    )
    parser.add_argument("--arrivals", default=None, help="burst | poisson:RATE | interval:SECONDS")
    parser.add_argument("--seed", type=int, default=0)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sim", action="store_true", help="simulate (default)")
    mode.add_argument("--real", action="store_true", help="run the real engine")
    parser.add_argument("--cost-model", default=None, help="cost model JSON for --sim")
    parser.add_argument(
        "--sweep", nargs="*", default=[], metavar="KEY=V1,V2", help="a grid of settings"
    )
    parser.add_argument("--replicas", type=int, default=1, help="simulated replicas per run")
    parser.add_argument("--router", default=None, help="router of the replicas (cache-aware)")
    parser.add_argument(
        "--router-option", nargs="*", type=key_value, default=[], metavar="KEY=VALUE"
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDR",
        help="run the simulations as Ray tasks (a local Ray, or the cluster at ADDR)",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args(argv)

    logging.getLogger("asyncengine.scheduler").setLevel(logging.ERROR)  # retract notes: counted
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = load_workload(args)
    save_trace(out / "workload.jsonl", workload)
    configs = build_configs(args)
    prompts = [w.prompt_ids for w in workload]
    optimal_by_page: dict[int, float] = {}

    sweep = parse_sweep(args.sweep)
    base = [
        SimJob(label, config, args.replicas, args.router, dict(args.router_option))
        for label, config in configs
    ]
    jobs = expand(base, sweep)
    if args.real and (args.ray or any(job.multi_replica for job in jobs)):
        raise SystemExit(
            f"--ray and {'/'.join(JOB_KEYS)} apply to simulated runs; --real runs one engine here"
        )
    if args.real:
        results = []
        for job in jobs:
            print(f"[{job.label}] policy={job.config.policy} ...", flush=True)
            records, summary, extra = run_one(job.config, workload, args)
            results.append((records, summary, extra))
    else:
        from asyncengine.sim.cost_model import CostModel

        cost = CostModel.load(args.cost_model) if args.cost_model else CostModel.default()
        print(f"{len(jobs)} simulated run(s){' on Ray' if args.ray else ''} ...", flush=True)
        results = [
            (r.records, r.summary, {**r.details, "cost_model": cost.description})
            for r in run_jobs(jobs, workload, cost, args.ray)
        ]

    runs: list[RunReport] = []
    details: dict[str, Any] = {}
    for job, (records, summary, extra) in zip(jobs, results, strict=True):
        label, config = job.label, job.config
        if config.page_size not in optimal_by_page:
            optimal_by_page[config.page_size] = optimal_hit(prompts, config.page_size).rate
        run = RunReport(label, config.policy, summary, records, optimal_by_page[config.page_size])
        runs.append(run)
        details[label] = {
            "config": config.to_dict(),
            "summary": summary.to_dict(),
            "optimal_hit_rate": run.optimal_hit_rate,
            **extra,
        }
        print(
            f"[{label}] {summary.num_completed}/{summary.num_requests} done, "
            f"{summary.output_throughput:.1f} tok/s, TTFT p50 {summary.ttft.p50 * 1e3:.1f} ms, "
            f"hit {summary.cache_hit_rate:.3f} (optimal {run.optimal_hit_rate:.3f})",
            flush=True,
        )

    mode_name = "real engine" if args.real else "simulator"
    header = (
        f"# Policy comparison\n\nworkload: `{args.workload}` ({len(workload)} requests, "
        f"{sum(len(p) for p in prompts)} prompt tokens), mode: {mode_name}"
    )
    if not args.real:
        header += f", cost model: {next(iter(details.values()))['cost_model']}"
    table = markdown_table(runs)
    (out / "results.md").write_text(header + "\n\n" + table, encoding="utf-8")
    (out / "summary.json").write_text(
        json.dumps(details, indent=2, default=str) + "\n", encoding="utf-8"
    )
    if not args.no_figures:
        write_figures(runs, out)
    print(table)
    return runs


if __name__ == "__main__":
    main()
