#!/usr/bin/env python
"""Compare engine configurations (policies) on one workload: a markdown table and figures.

    python scripts/compare_policies.py --configs configs/fcfs.toml configs/lpm.toml \
        --workload shared_prefix --arrivals poisson:20 --sim --out results/prefix
    python scripts/compare_policies.py --policies fcfs lpm dfs-weight --workload trace.jsonl --out DIR

``--workload`` is a generator name (see asyncengine.workloads.WORKLOADS; its arguments go in
``--workload-arg key=value``) or a JSONL trace. ``--sim`` (the default) drives the real
scheduler with a cost model on a virtual clock; ``--real`` runs the model. DIR receives
results.md, summary.json, workload.jsonl, ttft_cdf.png, itl_p99.png and hit_rate.png.
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
    """Run one configuration; returns its records, their summary and mode-specific details."""
    if args.real:
        from asyncengine.sim.engine_replay import replay_real

        records, stats = asyncio.run(replay_real(config, workload))
        retracts = stats.get("retractions")
        summary = summarize(records, retracts=None if retracts is None else int(retracts))  # type: ignore[call-overload]
        return records, summary, {"engine_stats": stats}
    from asyncengine.sim.cost_model import CostModel
    from asyncengine.sim.simulator import simulate

    cost = CostModel.load(args.cost_model) if args.cost_model else CostModel.default()
    result = simulate(config, workload, cost)
    details = {
        "steps": result.steps,
        "virtual_seconds": result.virtual_seconds,
        "wall_seconds": result.wall_seconds,
        "cpu_seconds": result.cpu_seconds,
        "scheduler_stats": result.scheduler_stats,
        "cost_model": cost.description,
    }
    return result.records, result.summary, details


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

    runs: list[RunReport] = []
    details: dict[str, Any] = {}
    for label, config in configs:
        print(f"[{label}] policy={config.policy} ...", flush=True)
        records, summary, extra = run_one(config, workload, args)
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
