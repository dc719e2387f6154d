#!/usr/bin/env python
"""Starvation check of a scheduling policy in the simulator (asyncengine/sim/starvation.py).

    python scripts/check_policy.py my_policies:MyPolicy
    python scripts/check_policy.py lpm --options '{"aging": 0.1}' --examples 40
    python scripts/check_policy.py priority --options '{"max_wait_tokens": 5000}' --json out.json

Hypothesis draws adversarial workloads (a stream of requests a policy likes to serve first,
faster than the engine serves them, and victims it does not like); each runs with its stream
and with one twice as long. The check fails when a request does not complete or when how far a
victim is overtaken (prefill tokens of later requests admitted before it) grows with the
stream; it reports the worst wait and overtaking in prefill tokens. Exit status 1 on failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.common.config import key_value
from asyncengine.script_main import run_main
from asyncengine.sim.starvation import Outcome, StarvationReport, check_starvation


def main(argv: Sequence[str] | None = None) -> StarvationReport:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("policy", help="module:Class, a built-in name or a composition (a+b)")
    parser.add_argument("--options", default="{}", help="policy options as a JSON object")
    parser.add_argument(
        "--examples", type=int, default=20, help="adversaries drawn (seeded by --seed)"
    )
    parser.add_argument("--growth", type=float, default=1.8, help="overtaking growth that fails")
    parser.add_argument(
        "--horizon-tokens", type=int, default=None, help="also fail overtaking above this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", nargs="*", type=key_value, default=[], metavar="KEY=VALUE",
        help="engine config of the simulated engine (default: starvation.CHECK_CONFIG)",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("-q", "--quiet", action="store_true", help="no line per example")
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    if not isinstance(options, dict):
        raise SystemExit("--options must be a JSON object")
    logging.getLogger("asyncengine.scheduler.scheduler").setLevel(logging.ERROR)

    def show(outcome: Outcome) -> None:
        if not args.quiet:
            verdict = "FAIL" if outcome.problem else "ok  "
            print(
                f"{verdict} stream={outcome.adversary.stream} worst wait "
                f"{outcome.worst_wait_tokens} tokens, worst overtaking "
                f"{outcome.worst_overtaken_tokens} tokens ({outcome.worst_overtaken_request})",
                flush=True,
            )

    report = check_starvation(
        args.policy,
        options,
        examples=args.examples,
        growth=args.growth,
        horizon_tokens=args.horizon_tokens,
        seed=args.seed,
        config=dict(args.set),
        on_example=show,
    )
    print(
        f"\npolicy {report.policy} {json.dumps(report.options)}: "
        f"{'PASSED' if report.passed else 'FAILED'} over {report.examples} adversaries\n"
        f"worst wait: {report.worst_wait_tokens} prefill tokens ({report.worst_wait_request})\n"
        f"worst overtaking: {report.worst_overtaken_tokens} prefill tokens "
        f"({report.worst_overtaken_request})"
    )
    if report.failure:
        print(f"failure: {report.failure}\nsmallest failing adversary: {report.failing_adversary}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    run_main(lambda: 0 if main().passed else 1)
