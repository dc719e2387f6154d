#!/usr/bin/env python
"""Reproduce a published scheduling result; write its section of docs/REPRODUCTIONS.md.

    python scripts/reproduce.py --list
    python scripts/reproduce.py vtc            # in the simulator (seconds)
    python scripts/reproduce.py vtc --real     # also on the real engine on the CPU (minutes)
    python scripts/reproduce.py all

Each run prints its table and verdict, rewrites only its own section of the page and stores its
numbers in docs/reproductions/NAME.json (``--page``/``--json-dir`` write elsewhere).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.script_main import run_main
from asyncengine.sim.reproductions import REPRODUCTIONS, Outcome
from asyncengine.sim.reproductions.document import MODES, write

ROOT = Path(__file__).resolve().parents[1]


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Outcome]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help="reproductions to run (or 'all')")
    parser.add_argument("--list", action="store_true", help="list the reproductions")
    parser.add_argument(
        "--real", action="store_true", help="also run on the real engine (SmolLM2, on the CPU)"
    )
    parser.add_argument("--page", default=str(ROOT / "docs" / "REPRODUCTIONS.md"))
    parser.add_argument("--json-dir", default=str(ROOT / "docs" / "reproductions"))
    args = parser.parse_args(argv)
    if args.list:
        for name, reproduction in REPRODUCTIONS.items():
            print(f"{name:<16} {reproduction.title}")
        return {}
    names = list(REPRODUCTIONS) if args.names == ["all"] else args.names
    if not names:
        parser.error("name a reproduction (see --list), or 'all'")
    unknown = [n for n in names if n not in REPRODUCTIONS]
    if unknown:
        parser.error(f"unknown reproduction(s) {unknown}; known: {', '.join(REPRODUCTIONS)}")
    logging.getLogger("asyncengine.scheduler.scheduler").setLevel(logging.ERROR)  # retract notes
    results: dict[str, dict[str, Outcome]] = {}
    for name in names:
        reproduction = REPRODUCTIONS[name]
        for mode in ("sim", "real") if args.real else ("sim",):
            start = time.perf_counter()
            outcome = reproduction.run(real=mode == "real")
            path = write(reproduction, mode, outcome, Path(args.page), Path(args.json_dir))
            results.setdefault(name, {})[mode] = outcome
            verdict = "holds" if outcome.holds else "DOES NOT HOLD"
            print(f"## {reproduction.title}: {MODES[mode].lower()}, the claim {verdict}")
            print(outcome.table)
            print(outcome.verdict)
            print(f"({time.perf_counter() - start:.1f} s; {path}, {args.page})\n", flush=True)
    return results


if __name__ == "__main__":
    run_main(main)
