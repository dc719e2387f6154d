"""Micro-benchmark of the stop-string matcher alone: time per streamed token against the text
held back, for the automaton (``text/stop_strings.py``) and for a rescan of every held length of
every stop string on each token (the matcher it replaced, kept here as the baseline).

The stream is the costly case: fifteen long stop strings, one of which keeps matching the
output (one repeated character, as a ``logit_bias`` can force), so everything is held back. At
each held length H the per-token time is the median over ``--tokens`` one-character tokens
pushed once H characters are held; CPU time per token is reported too (compare that one on a
loaded machine). Prints a table, writes JSON.

``--http``: the whole request over loopback instead, against ``asyncengine serve`` started here
on the embedded default model (or ``--url``): one completion of ``--output-tokens`` tokens
forced to one character (``logit_bias``, ``ignore_eos``) with fifteen stop strings at the length
limit, one of which holds back its last 1,023 characters on every token, against the same
request without stop strings; ``--repeats`` of each, interleaved (with, without, with, ...) so
the machine's load falls on both; medians and their ratio.

    python scripts/bench_stop_strings.py [--held 1500 8000] [--out bench_results/bench_stop_strings.json]
    python scripts/bench_stop_strings.py --http [--output-tokens 6000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # stop_strings_http beside it

from asyncengine.script_main import run_main
from asyncengine.text.stop_strings import StopStringFilter


def rescanning_push(pending: str, delta: str, stop: Sequence[str]) -> tuple[str, str | None, int]:
    """The baseline: find each stop string in the held text plus the delta, then try every
    held length of every stop string (what one push cost before the automaton)."""
    text = pending + delta
    best_end = -1
    matched: str | None = None
    for candidate in stop:
        index = text.find(candidate)
        if index == -1:
            continue
        end = index + len(candidate)
        if matched is None or end < best_end or (end == best_end and len(candidate) > len(matched)):
            best_end, matched = end, candidate
    if matched is not None:
        return text[: best_end - len(matched)], matched, 0
    held = 0
    for candidate in stop:
        for length in range(min(len(candidate) - 1, len(text)), held, -1):
            if text.endswith(candidate[:length]):
                held = length
                break
    return text[: len(text) - held], None, held


def stop_set(longest: int) -> list[str]:
    """Fifteen stop strings of ``longest`` characters; the last holds back a run of "a" (the
    others are then tried at every held length before it)."""
    return [chr(ord("b") + i) * longest for i in range(14)] + ["a" * (longest - 1) + "!"]


def time_automaton(held: int, stops: list[str], tokens: int) -> tuple[float, float, float]:
    """Median wall and CPU seconds per token, and matching steps per character, at ``held``."""
    f = StopStringFilter(stops)
    for _ in range(held):
        f.push("a")
    steps_before = f.steps
    walls, cpus = [], []
    for _ in range(tokens):
        wall, cpu = time.perf_counter(), time.process_time()
        f.push("a")
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    assert f.matched is None and len(f.pending) == held + tokens
    return statistics.median(walls), sum(cpus) / tokens, (f.steps - steps_before) / tokens


def time_rescan(held: int, stops: list[str], tokens: int) -> tuple[float, float]:
    pending = "a" * held
    walls, cpus = [], []
    for _ in range(tokens):
        wall, cpu = time.perf_counter(), time.process_time()
        emit, matched, kept = rescanning_push(pending, "a", stops)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        assert emit == "" and matched is None and kept == held + 1
    return statistics.median(walls), sum(cpus) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, nargs="+", default=[1500, 8000])
    parser.add_argument("--tokens", type=int, default=50, help="tokens timed per held length")
    parser.add_argument(
        "--output-tokens",
        type=int,
        default=6000,
        help="a request's length, for the whole-request estimate",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--http", action="store_true", help="whole requests over loopback")
    parser.add_argument("--url", default=None, help="with --http: a running server")
    parser.add_argument("--repeats", type=int, default=3, help="with --http: runs of each")
    args = parser.parse_args()
    if args.http:
        from stop_strings_http import run_http

        run_http(args.url, args.output_tokens, args.repeats, args.out)
        return
    args.out = args.out or Path("bench_results/bench_stop_strings.json")

    longest = max(max(args.held), args.output_tokens) + args.tokens + 2
    stops = stop_set(longest)
    rows = []
    for held in args.held:
        new_wall, new_cpu, steps = time_automaton(held, stops, args.tokens)
        old_wall, old_cpu = time_rescan(held, stops, args.tokens)
        rows.append(
            {
                "held_chars": held,
                "rescan_ms_per_token": old_wall * 1e3,
                "rescan_cpu_ms_per_token": old_cpu * 1e3,
                "automaton_us_per_token": new_wall * 1e6,
                "automaton_cpu_us_per_token": new_cpu * 1e6,
                "automaton_steps_per_char": steps,
                "speedup": old_wall / new_wall,
            }
        )
    # the whole request: every token pays the matcher at the held length it has reached
    f = StopStringFilter(stops)
    start = time.process_time()
    for _ in range(args.output_tokens):
        f.push("a")
    whole_cpu = time.process_time() - start

    print(f"stop strings: {len(stops)} of {longest} characters; one holds back the output")
    print(
        f"{'held':>6} {'rescan ms/tok':>14} {'automaton us/tok':>17} {'steps/char':>11} "
        f"{'speedup':>9}"
    )
    for row in rows:
        print(
            f"{row['held_chars']:>6} {row['rescan_ms_per_token']:>14.3f} "
            f"{row['automaton_us_per_token']:>17.2f} {row['automaton_steps_per_char']:>11.2f} "
            f"{row['speedup']:>8.0f}x"
        )
    print(
        f"a {args.output_tokens}-token request, every token held: {whole_cpu * 1e3:.1f} ms of "
        f"CPU in the automaton ({whole_cpu / args.output_tokens * 1e6:.2f} us per token)"
    )
    report = {
        "benchmark": "stop_strings",
        "stop_strings": len(stops),
        "stop_length": longest,
        "tokens_timed": args.tokens,
        "rows": rows,
        "whole_request": {
            "output_tokens": args.output_tokens,
            "automaton_cpu_ms": whole_cpu * 1e3,
        },
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "load_average": os.getloadavg()[0],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
