#!/usr/bin/env python
"""bench_radix.py of two checkouts, interleaved (A B, B A, A B, ...), so load on the machine
falls on both alike; the median rate of each phase per checkout, and new/old.

Each checkout runs its own scripts/micro/bench_radix.py (one repeat per run) on its own
``asyncengine`` (compiled or not, as that checkout was built). An older commit to compare with:

    git archive COMMIT | tar -x -C /tmp/radix_old
    (cd /tmp/radix_old && /path/to/.venv/bin/python scripts/build_native.py)
    .venv/bin/python scripts/micro/bench_radix_ab.py --old /tmp/radix_old --new . --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("insert", "match", "lock_unlock", "evict")


def run(root: Path, out: Path) -> list[dict]:
    script = root / "scripts" / "micro" / "bench_radix.py"
    command = [sys.executable, str(script), "--repeats", "1", "--out", str(out)]
    subprocess.run(command, check=True, cwd=root, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["results"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--new", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    arms = {"old": args.old.resolve(), "new": args.new.resolve()}
    results: dict[str, list[list[dict]]] = {"old": [], "new": []}
    loads: list[float] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            order = ("old", "new") if index % 2 == 0 else ("new", "old")
            for name in order:
                loads.append(os.getloadavg()[0])
                results[name].append(run(arms[name], Path(scratch) / f"{name}.json"))
    print(
        f"{args.rounds} rounds in {time.perf_counter() - started:.0f} s; load average (1 min) "
        f"median {statistics.median(loads):.1f}, {min(loads):.1f}-{max(loads):.1f}"
    )
    print(
        "| page | clock | phase | old ops/s | new ops/s | new/old |\n|---:|---|---|---:|---:|---:|"
    )
    for page_index, result in enumerate(results["old"][0]):
        for clock in ("cpu_ops_per_s", "wall_ops_per_s"):
            for phase in PHASES:
                old, new = (
                    statistics.median(run[page_index][clock][phase] for run in results[name])
                    for name in ("old", "new")
                )
                print(
                    f"| {result['page_size']} | {clock.split('_')[0]} | {phase} | {old:,.0f} | "
                    f"{new:,.0f} | {new / old:.3f} |"
                )


if __name__ == "__main__":
    main()
