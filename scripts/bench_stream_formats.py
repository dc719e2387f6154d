#!/usr/bin/env python
"""One stream (batch-1 decode) per model and format, ours and llama.cpp interleaved round by round.

For each model (scripts/make_real_models.py's shapes) and GGUF format, our engine is loaded once
and kept (the int8 panels it builds between its first steps built before any round); then each
of ``--rounds`` rounds times, back to back:

- asyncengine: a ``--prompt-len`` prompt with one token out, then with ``--output-len`` out:
  (output_len - 1) / (full - first) tok/s;
- llama.cpp: ``llama-bench -p 0 -n OUTPUT_LEN -r 1`` with its weight repacking (its fastest
  decode; repacking crashes only its prompt processing on AMX CPUs, and ``-p 0`` has none) and
  with ``--repack 0`` (the weights as stored: what llama-server ``--no-repack`` decodes with).

Interleaving puts both systems under the same background load in each round; the figures are
per-round medians, and ours over llama.cpp is taken against llama.cpp's faster mode. Each round
records the 1-minute load average (a busy machine's ratios are noise; say so when quoting them).
Each run's bound is the machine's read rate measured just before it (a VM's memory can switch
between rates within minutes) over the GGUF's tensor bytes (one read per token); a system's
share of it is the median over the rounds.

    .venv/bin/python scripts/bench_stream_formats.py --models llama-3.2-1b --formats Q4_K_M Q8_0 \\
        --rounds 5 --out /tmp/stream_formats.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: systems, peers

import make_real_models as models
from bench_real_sizes import Plan, engine_config, random_prompt, step_bytes, vocab_size
from bench_single_stream import bound_tokens_per_second, read_rate
from peers.llamacpp import launcher as peer_llamacpp
from systems import WARMUP_PROMPT, cell, finish, greedy

from asyncengine.common.config import key_value
from asyncengine.script_main import run_main

LLAMACPP_MODES = {"repacked": ("--repack", "1"), "as-stored": ("--repack", "0")}


def llama_bench() -> Path:
    tool = peer_llamacpp.server_binary().with_name("llama-bench")
    if not tool.is_file():
        raise SystemExit(f"{tool} is missing: run scripts/setup_llamacpp.sh")
    return tool


def llamacpp_decode(gguf: Path, output_len: int, threads: int, mode: tuple[str, str]) -> float:
    """llama-bench's tg tok/s for one run of ``output_len`` tokens (NaN when it fails)."""
    command = [str(llama_bench()), "-m", str(gguf), "-p", "0", "-n", str(output_len)]
    command += ["-r", "1", "-t", str(threads), *mode, "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"llama-bench failed ({done.returncode}): {done.stderr[-400:]}", file=sys.stderr)
        return math.nan
    records = [r for r in json.loads(done.stdout) if r.get("n_gen")]
    return float(records[0]["avg_ts"]) if records else math.nan


async def rounds_for(
    gguf: Path,
    plan: Plan,
    rounds: int,
    threads: int,
    modes: Sequence[str],
    engine_args: Sequence[tuple[str, Any]],
) -> dict[str, Any]:
    from asyncengine.api.engine import AsyncEngine

    vocab = vocab_size(gguf)
    prompt = random_prompt(vocab, plan.prompt_len, plan.seed)
    ours: list[float] = []
    theirs: dict[str, list[float]] = {name: [] for name in modes}
    loads: list[float] = []
    reads: dict[str, list[float]] = {"asyncengine": [], **{f"llamacpp {n}": [] for n in modes}}
    async with AsyncEngine(engine_config(gguf, plan, engine_args)) as engine:
        await engine.generate(WARMUP_PROMPT, greedy(4))
        await engine.one_time_work_done()  # start-up's deferred work (int8 panels): not timed
        await engine.generate(prompt, greedy(8))
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            reads["asyncengine"].append(read_rate())
            start = time.perf_counter()
            await engine.generate(prompt, greedy(1))
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = await engine.generate(prompt, greedy(plan.output_len))
            full = time.perf_counter() - start
            if len(out.token_ids) != plan.output_len:
                raise RuntimeError(f"asyncengine gave {len(out.token_ids)} of {plan.output_len}")
            ours.append((plan.output_len - 1) / (full - first))
            for name in modes:
                reads[f"llamacpp {name}"].append(read_rate())
                theirs[name].append(
                    llamacpp_decode(gguf, plan.output_len, threads, LLAMACPP_MODES[name])
                )
            line = ", ".join(
                f"llama.cpp {n} {v[-1]:.1f} (read {reads[f'llamacpp {n}'][-1] / 1e9:.1f} GB/s)"
                for n, v in theirs.items()
            )
            print(
                f"  round {r}: ours {ours[-1]:.1f} (read {reads['asyncengine'][-1] / 1e9:.1f} GB/s),"
                f" {line} (load {loads[-1]:.1f})",
                flush=True,
            )
    return {
        "asyncengine": ours,
        **{f"llamacpp {n}": v for n, v in theirs.items()},
        "load": loads,
        "read_bytes_per_second": reads,
    }


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def summarize(entry: dict[str, Any], modes: Sequence[str]) -> None:
    """Medians per system, each system's median share of its rounds' bounds, and ours over
    llama.cpp's faster mode."""
    runs = entry["rounds"]
    reads = runs["read_bytes_per_second"]
    step = entry["weights"]["bytes"]
    systems = ["asyncengine", *(f"llamacpp {n}" for n in modes)]
    ours = median(runs["asyncengine"])
    best = max((median(runs[system]) for system in systems[1:]), default=math.nan)
    entry["medians"] = {system: median(runs[system]) for system in systems}
    entry["medians"]["load"] = median(runs["load"])
    entry["medians"]["read_gb_per_second"] = median([r for v in reads.values() for r in v]) / 1e9
    entry["fractions_of_bound"] = {
        system: median(
            [
                tokens / bound_tokens_per_second(read, step)
                for tokens, read in zip(runs[system], reads[system], strict=True)
            ]
        )
        for system in systems
    }
    entry["ours_over_best_llamacpp"] = ours / best if best > 0 else math.nan


def speed(entry: dict[str, Any], system: str) -> str:
    """A system's median tok/s and, in brackets, its median share of the bound."""
    share = cell(entry["fractions_of_bound"][system], "{:.0%}")
    return f"{cell(entry['medians'][system], '{:.1f}')} ({share})"


def table(result: dict[str, Any]) -> str:
    modes = result["llamacpp_modes"]
    header = ["model", "format", "GB", "ours tok/s (of bound)"]
    header += [f"llama.cpp {n}" for n in modes]
    header += ["ours / best llama.cpp", "read GB/s", "load"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for entry in result["entries"]:
        m = entry["medians"]
        cells = [
            entry["model"],
            entry["format"],
            cell(entry["weights"]["bytes"] / 1e9, "{:.2f}"),
            speed(entry, "asyncengine"),
            *(speed(entry, f"llamacpp {n}") for n in modes),
            cell(entry["ours_over_best_llamacpp"], "{:.2f}x"),
            cell(m["read_gb_per_second"], "{:.1f}"),
            cell(m["load"], "{:.1f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    plan = result["plan"]
    lines.append(
        f"\nmedians of {result['rounds']} interleaved rounds; {plan['prompt_len']}-token prompt, "
        f"{plan['output_len']} tokens; (of bound): the median share of the bound, the read rate "
        f"measured before each run / the GGUF's bytes; read GB/s: those rates' median; load: "
        f"the 1-minute load average at each round ({result['threads']} threads each)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["llama-3.2-1b"], choices=sorted(models.SHAPES)
    )
    parser.add_argument(
        "--formats",
        nargs="+",
        default=list(models.FORMATS),
        choices=["bf16", *models.FORMATS, *models.EXTRA_FORMATS],
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="llama-bench -t (default: all)")
    parser.add_argument(
        "--llamacpp-modes",
        nargs="+",
        default=list(LLAMACPP_MODES),
        choices=list(LLAMACPP_MODES),
        help="llama-bench with its weight repacking and/or with the weights as stored",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="an asyncengine config key for every run (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.output_len < 2 or args.prompt_len < 1:
        raise SystemExit("need --rounds >= 1, --output-len >= 2 and --prompt-len >= 1")
    llama_bench()
    threads = args.threads or os.cpu_count() or 1
    plan = Plan(args.prompt_len, args.output_len, 1, (), 0, 0, (), args.seed)
    started = time.time()
    entries = []
    for name in args.models:
        paths = models.make(name, args.formats)
        for fmt in args.formats:
            print(f"{name} {fmt}:", flush=True)
            runs = asyncio.run(
                rounds_for(
                    paths[fmt], plan, args.rounds, threads, args.llamacpp_modes, args.engine_arg
                )
            )
            entries.append(
                {
                    "model": name,
                    "format": fmt,
                    "path": str(paths[fmt]),
                    "weights": step_bytes(paths[fmt]),
                    "rounds": runs,
                }
            )
    for entry in entries:
        summarize(entry, args.llamacpp_modes)
    result: dict[str, Any] = {
        "mode": "stream_formats",
        "plan": asdict(plan),
        "rounds": args.rounds,
        "llamacpp_modes": args.llamacpp_modes,
        "entries": entries,
        "threads": threads,
    }
    return finish(result, "scripts/bench_stream_formats.py", argv, started, args.out, table)


if __name__ == "__main__":
    run_main(main)
