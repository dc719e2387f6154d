#!/usr/bin/env python
"""Short requests sent while a long prompt is being computed: their time to first token.

Launches ``asyncengine serve`` (engine flags after ``--``) once per run and
``--short-prompt-tokens`` value, sends one long prompt, then ``--num-short`` short prompts
``--short-interval`` seconds apart starting ``--short-delay`` seconds after it (streaming
``/generate``, greedy, exact output lengths), and reports each value's short-request TTFT
(median and worst), the long prompt's TTFT and the run's wall time, medians over ``--repeats``
(the values alternate within each repeat). Loopback only.
    python scripts/bench_short_beside_long.py --repeats 3 --out bench_results/short_long.json
    python scripts/bench_short_beside_long.py --long-len 6000 --vocab-size 128256 \\
        -- --model ~/.cache/asyncengine/models/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import DEFAULT_VOCAB, RunOptions, run_workload, split_serve_args
from systems import AsyncEngineSystem, write_json

from asyncengine.script_main import run_main
from asyncengine.workloads.trace import WorkloadRequest


def workload(args: argparse.Namespace, seed: int) -> list[WorkloadRequest]:
    """One long prompt at 0 s, then the short ones; fresh random ids per run (no cache hits)."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(0, args.vocab_size, size=n).tolist()

    items = [WorkloadRequest("long", 0.0, ids(args.long_len), args.output_len)]
    for i in range(args.num_short):
        arrival = args.short_delay + i * args.short_interval
        items.append(WorkloadRequest(f"short-{i}", arrival, ids(args.short_len), args.output_len))
    return items


def one_run(
    args: argparse.Namespace, serve_args: list[str], lane: int, seed: int
) -> dict[str, Any]:
    log = Path(tempfile.gettempdir()) / f"bench_short_beside_long_{lane}.log"
    flags = [*serve_args, "--short-prompt-tokens", str(lane)]
    server = AsyncEngineSystem.server(flags, args.startup_timeout, log)
    server.start()
    try:
        options = RunOptions(server.base_url, request_timeout=args.request_timeout, progress=False)
        result = asyncio.run(run_workload(workload(args, seed), options))
    finally:
        server.stop()
    records = {o.record.rid: o.record for o in result.outcomes}
    failed = [rid for rid, r in records.items() if not r.completed]
    if failed:
        raise SystemExit(f"requests failed with --short-prompt-tokens {lane}: {failed}")

    def ttft(rid: str) -> float:
        record = records[rid]
        return record.token_times[0] - record.arrival_time

    shorts = [ttft(rid) for rid in records if rid.startswith("short-")]
    return {
        "short_ttft_p50": statistics.median(shorts),
        "short_ttft_max": max(shorts),
        "long_ttft": ttft("long"),
        "wall_seconds": result.duration,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lanes", default="0,256", help="--short-prompt-tokens values")
    parser.add_argument("--long-len", type=int, default=2048)
    parser.add_argument("--short-len", type=int, default=16)
    parser.add_argument("--num-short", type=int, default=4)
    parser.add_argument("--short-delay", type=float, default=0.5, help="seconds")
    parser.add_argument("--short-interval", type=float, default=0.5, help="seconds")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="prompt ids < this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    own, serve_args = split_serve_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    lanes = [int(v) for v in args.lanes.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {lane: [] for lane in lanes}
    for repeat in range(args.repeats):
        for lane in lanes:
            runs[lane].append(one_run(args, serve_args, lane, seed=repeat))
    keys = ("short_ttft_p50", "short_ttft_max", "long_ttft", "wall_seconds")
    medians = {
        lane: {k: statistics.median(r[k] for r in rs) for k in keys} for lane, rs in runs.items()
    }
    print(
        f"one prompt of {args.long_len} tokens, then {args.num_short} of {args.short_len} "
        f"every {args.short_interval} s from {args.short_delay} s; medians of {args.repeats}"
    )
    print("| --short-prompt-tokens | short TTFT p50 s | short TTFT max s | long TTFT s | wall s |")
    print("|---:|---:|---:|---:|---:|")
    for lane, m in medians.items():
        cells = " | ".join(f"{m[k]:.2f}" for k in keys)
        print(f"| {lane} | {cells} |")
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "serve_args": serve_args}
    result["medians"] = {str(lane): m for lane, m in medians.items()}
    result["runs"] = {str(lane): rs for lane, rs in runs.items()}
    if args.out is not None:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    run_main(main)
