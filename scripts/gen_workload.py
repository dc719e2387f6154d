#!/usr/bin/env python
"""Generate a named synthetic workload and save it as a JSONL trace.

    python scripts/gen_workload.py shared_prefix --out prefix.jsonl --arrivals poisson:20 \
        --arg num_groups=16 --arg prefix_len=2048 --seed 1

Prints the request count, token totals and the offline optimal prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.script_main import run_main
from asyncengine.workloads import WORKLOADS, Arrivals, make_workload, save_trace


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("name", choices=sorted(WORKLOADS))
    parser.add_argument("--out", required=True, help="trace file to write (JSONL)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--arrivals", default=None, help="burst | poisson:RATE | interval:SECONDS")
    parser.add_argument("--text", action="store_true", help="also store a pseudo-word prompt text")
    parser.add_argument(
        "--page-size", type=int, default=16, help="page size for the optimal hit rate"
    )
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="generator argument (JSON value), repeatable",
    )
    args = parser.parse_args(argv)

    kwargs: dict[str, object] = {"seed": args.seed}
    if args.text:  # only some generators write a prompt text
        kwargs["text"] = True
    if args.vocab_size is not None:
        kwargs["vocab_size"] = args.vocab_size
    if args.arrivals:
        kwargs["arrivals"] = Arrivals.parse(args.arrivals)
    for pair in args.arg:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--arg expects key=value, got {pair!r}")
        try:
            kwargs[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key.replace("-", "_")] = value
    requests = make_workload(args.name, **kwargs)
    save_trace(args.out, requests)
    best = optimal_hit([r.prompt_ids for r in requests], args.page_size)
    info: dict[str, object] = {
        "requests": len(requests),
        "prompt_tokens": best.prompt_tokens,
        "output_tokens": sum(r.output_len for r in requests),
        "last_arrival_s": max((r.arrival_time for r in requests), default=0.0),
        "optimal_hit_rate": round(best.rate, 4),
        "out": args.out,
    }
    print(json.dumps(info))
    return info


if __name__ == "__main__":
    run_main(main)
