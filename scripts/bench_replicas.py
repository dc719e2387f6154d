#!/usr/bin/env python
"""1 vs 2 engine replicas on Ray Serve, cache-aware vs round-robin routing, side by side.

Each setup is ``asyncengine serve --replicas N --router R`` launched on loopback and driven
by scripts/bench_serving.py with the same shared-prefix workload (streamed /generate, Poisson
arrivals); setups alternate within each repeat so that a shared machine's load hits them
alike. Reported per setup: the prefix-cache hit rate (cached / prompt tokens), request and
output-token throughput, TTFT and E2E percentiles: medians over the repeats (table + JSON).

    python scripts/bench_replicas.py --repeats 3 --out bench_results/replicas \\
        -- --kv-cache-tokens 4096 --replica-cpus 1

Arguments after ``--`` go to every ``asyncengine serve``. Each replica gets ``--replica-cpus``
CPUs (default 1), so two replicas use twice the compute of one: the throughput column is what
scaling out buys, the hit-rate column what routing keeps of the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.script_main import run_main

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving

SETUPS: list[tuple[str, list[str]]] = [
    ("1 replica", ["--replicas", "1"]),
    ("2 replicas, round-robin", ["--replicas", "2", "--router", "round-robin"]),
    ("2 replicas, cache-aware", ["--replicas", "2", "--router", "cache-aware"]),
    # routes on the replicas' published KV cache events instead of its own guesses
    ("2 replicas, kv-events", ["--replicas", "2", "--router", "kv-events"]),
]
COLUMNS = (
    ("hit rate", lambda s: f"{s['cache_hit_rate']:.1%}"),
    ("req/s", lambda s: f"{s['request_throughput']:.2f}"),
    ("out tok/s", lambda s: f"{s['output_throughput']:.1f}"),
    ("TTFT p50 ms", lambda s: f"{s['ttft']['p50'] * 1e3:.0f}"),
    ("TTFT p90 ms", lambda s: f"{s['ttft']['p90'] * 1e3:.0f}"),
    ("E2E p50 ms", lambda s: f"{s['e2e']['p50'] * 1e3:.0f}"),
)


def median_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure the table shows, over the repeats."""
    summaries = [r["summary"] for r in runs]

    def med(get: Any) -> float:
        return statistics.median(get(s) for s in summaries)

    return {
        "cache_hit_rate": med(lambda s: s["cache_hit_rate"]),
        "request_throughput": med(lambda s: s["request_throughput"]),
        "output_throughput": med(lambda s: s["output_throughput"]),
        "ttft": {q: med(lambda s, q=q: s["ttft"][q]) for q in ("p50", "p90")},
        "e2e": {"p50": med(lambda s: s["e2e"]["p50"])},
        "failed": max(s["num_failed"] for s in summaries),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        serve_args = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-groups", type=int, default=12)
    parser.add_argument("--questions-per-group", type=int, default=5)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--setups",
        nargs="+",
        default=None,
        metavar="LABEL",
        help=f"run only these setups (default: all of {[label for label, _ in SETUPS]})",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)
    unknown = set(args.setups or []) - {label for label, _ in SETUPS}
    if unknown:  # before the output folder is made: a mistake leaves nothing behind
        raise ValueError(f"unknown setups {sorted(unknown)}: choose from {[s for s, _ in SETUPS]}")
    args.out.mkdir(parents=True, exist_ok=True)
    bench = [
        "--launch", "--workload", "shared_prefix",
        "--workload-arg", f"num_groups={args.num_groups}",
        "--workload-arg", f"questions_per_group={args.questions_per_group}",
        "--workload-arg", f"prefix_len={args.prefix_len}",
        "--workload-arg", f"output_len={args.output_len}",
        "--request-rate", str(args.request_rate), "--no-progress", "--startup-timeout", "600",
        *(["--model", args.model] if args.model else []),
    ]  # fmt: skip
    setups = [(label, setup) for label, setup in SETUPS if label in (args.setups or [label])]
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in setups}
    loads: list[float] = []
    for repeat in range(args.repeats):
        for label, setup in setups:
            print(f"== repeat {repeat + 1}/{args.repeats}: {label}", flush=True)
            name = label.replace(" ", "_").replace(",", "")
            for attempt in (1, 2):  # a launch can fail on a loaded machine: once more
                try:
                    result = bench_serving.main(
                        [*bench, "--label", label,
                         "--out", str(args.out / f"{name}_{repeat}.json"),
                         "--server-log", str(args.out / f"{name}_{repeat}.log"),
                         "--", "--log-interval", "0", "--server-log-interval", "0",
                         *setup, *serve_args]
                    )  # fmt: skip
                    break
                except SystemExit as exc:
                    if attempt == 2:
                        raise
                    print(f"launch failed ({str(exc)[:200]}); trying again", flush=True)
            results[label].append(result)
            loads.extend(result["load_average_start_end"])
    medians = {label: median_summary(runs) for label, runs in results.items()}
    header = "| setup | " + " | ".join(c for c, _ in COLUMNS) + " | failed |"
    lines = [header, "|---" * (len(COLUMNS) + 2) + "|"]
    for label, summary in medians.items():
        cells = " | ".join(fmt(summary) for _, fmt in COLUMNS)
        lines.append(f"| {label} | {cells} | {summary['failed']} |")
    table = "\n".join(lines)
    note = (
        f"\nmedians of {args.repeats} repeats; 1-minute load average during the runs "
        f"{min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs; serve args: "
        f"{' '.join(serve_args) or '(none)'}"
    )
    (args.out / "results.md").write_text(table + "\n" + note + "\n", encoding="utf-8")
    report = {"medians": medians, "runs": results, "serve_args": serve_args}
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(table + note)
    return report


if __name__ == "__main__":
    run_main(main)
