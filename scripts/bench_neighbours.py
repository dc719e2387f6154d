#!/usr/bin/env python
"""The engine beside busy neighbours: what choosing each CPU step's thread count buys.

Each run is a fresh process serving ``--num-requests`` requests at once (greedy,
``--output-len`` tokens each, the embedded default model, the default config), timed from the
first submission to the last token, while ``N`` neighbour processes spin on the cores (``N`` in
``--neighbours``, 0: quiet). Two settings alternate within each repeat: ``adaptive`` (the
default: ``executor/cpu/step_threads.py`` picks all threads or one per step, and every step chooses
once steps on all threads get less than their cores) and ``all threads``
(``ASYNCENGINE_ADAPTIVE_THREADS=0``: every step on the process's starting count). The table
gives medians of ``--repeats``: wall and CPU seconds, out tok/s, the median decode step, and
how many decode steps of several rows (of one row for a lone request) ran on one thread.
``--deterministic`` runs the engine in deterministic mode; ``--wait-policies`` crosses the
settings with libgomp's ``OMP_WAIT_POLICY`` (read when the library loads: each run is a fresh
process; ``default`` leaves it unset: threads spin a while at each barrier, then sleep).

    .venv/bin/python scripts/bench_neighbours.py --neighbours 0 1 --repeats 3 \
        --out bench_results/neighbours.json
    .venv/bin/python scripts/bench_neighbours.py --deterministic --num-requests 1 \
        --wait-policies default passive

Stop other work on the machine first: the neighbours are the load this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {"adaptive": "1", "all threads": "0"}
SPIN = "while True: pass"
WAIT_ENV = "OMP_WAIT_POLICY"


async def serve_batch(num_requests: int, output_len: int, deterministic: bool) -> dict[str, Any]:
    """One batch on a fresh engine; each step's rows, kind, thread count and time are logged."""
    import torch

    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.config import EngineConfig
    from asyncengine.common.sampling_params import SamplingParams
    from asyncengine.executor.runner import ModelRunner

    steps: list[tuple[int, bool, int, float]] = []  # rows, with prompt rows, threads, seconds
    execute = ModelRunner._execute

    def logged(runner: ModelRunner, plan: Any) -> Any:
        start = time.perf_counter()
        out = execute(runner, plan)
        seconds = time.perf_counter() - start
        steps.append((plan.num_tokens, bool(plan.extends), torch.get_num_threads(), seconds))
        return out

    ModelRunner._execute = logged  # type: ignore[method-assign]
    engine = await AsyncEngine(EngineConfig(deterministic=deterministic)).start()
    greedy = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    await engine.generate("A warm-up", SamplingParams(max_new_tokens=4, temperature=0.0))
    steps.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(
        *[
            engine.generate(f"Tell me a story, number {i}, about", greedy)
            for i in range(num_requests)
        ]
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await engine.stop()
    fewest = 2 if num_requests > 1 else 1  # rows of the decode steps counted
    decodes = [s for s in steps if not s[1] and s[0] >= fewest]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "out_tok_s": num_requests * output_len / wall,
        "decode_step_ms_p50": 1000 * statistics.median(s[3] for s in decodes) if decodes else None,
        "decode_steps": len(decodes),
        "decode_steps_on_one_thread": sum(1 for s in decodes if s[2] == 1),
        "threads": (steps and max(s[2] for s in steps)) or None,
    }


def run_once(setting: str, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, ASYNCENGINE_ADAPTIVE_THREADS=SETTINGS[setting])
    env.pop(WAIT_ENV, None)
    if policy != "default":
        env[WAIT_ENV] = policy
    child = [str(args.num_requests), str(args.output_len), str(int(args.deterministic))]
    command = [sys.executable, __file__, "--child", *child]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--neighbours", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench_results/neighbours.json"))
    parser.add_argument("--deterministic", action="store_true", help="deterministic mode")
    parser.add_argument(
        "--wait-policies", nargs="+", default=["default"], choices=("default", "active", "passive")
    )
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        requests, output_len, deterministic = args.child
        print(json.dumps(asyncio.run(serve_batch(requests, output_len, bool(deterministic)))))
        return 0
    settings = [(s, p) for p in args.wait_policies for s in SETTINGS]
    rows: list[dict[str, Any]] = []
    for count in args.neighbours:
        neighbours = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
        try:
            runs: dict[tuple[str, str], list[dict[str, Any]]] = {s: [] for s in settings}
            for _ in range(args.repeats):
                for setting, policy in settings:
                    runs[(setting, policy)].append(run_once(setting, policy, args))
        finally:
            for process in neighbours:
                process.kill()
                process.wait()
        for (setting, policy), done in runs.items():
            keys = ("wall_s", "cpu_s", "out_tok_s", "decode_step_ms_p50", "decode_steps")
            row = {"neighbours": count, "setting": setting, "wait_policy": policy}
            row |= {k: median_of(done, k) for k in keys}
            row["decode_steps_on_one_thread"] = median_of(done, "decode_steps_on_one_thread")
            row["runs"] = done
            rows.append(row)
    print(
        "| neighbours | setting | OMP_WAIT_POLICY | wall s | CPU s | out tok/s | "
        "decode step p50 ms | on one thread |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['neighbours']} | {r['setting']} | {r['wait_policy']} | {r['wall_s']:.2f} | "
            f"{r['cpu_s']:.2f} | "
            f"{r['out_tok_s']:.1f} | {r['decode_step_ms_p50']:.1f} | "
            f"{r['decode_steps_on_one_thread']:.0f} of {r['decode_steps']:.0f} |"
        )
    by = {(r["neighbours"], r["setting"], r["wait_policy"]): r["out_tok_s"] for r in rows}
    for count in args.neighbours:
        for policy in args.wait_policies:
            ratio = by[(count, "adaptive", policy)] / by[(count, "all threads", policy)]
            print(
                f"{count} neighbour(s), {policy} wait: adaptive / all threads = "
                f"{ratio:.2f}x out tok/s"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
