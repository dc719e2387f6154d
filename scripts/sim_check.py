#!/usr/bin/env python
"""Does the simulator predict the real engine? The fidelity report of docs/EXPERIMENTS.md.

Three policies x two workloads run on the real executor of this CPU (the engine core with the
real model, one torch thread, each step timed on this thread's CPU clock so that other load on
the machine inflates it little), beside one calibration run per workload (another seed, FCFS).
The calibration runs are written as live traces (the format ``serve --record-trace`` writes)
and the cost model is fitted from those traces, as ``compare_policies --fit-from-trace`` fits
one. The simulator then replays each checked run; the report gives the error of TTFT p50/p99,
ITL p50 and throughput per run against the goal (10 %), and says where it is missed:

    python scripts/sim_check.py --out docs/experiments/sim_vs_real
    python scripts/sim_check.py --out /tmp/check --engine    # and the AsyncEngine, wall clock
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncengine.common.config import EngineConfig
from asyncengine.script_main import run_main
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.fidelity import (
    FIDELITY_METRICS,
    GOAL,
    MetricComparison,
    fidelity,
    write_measured_trace,
)
from asyncengine.sim.sim_vs_real import (
    check_workload,
    compare,
    markdown_comparison,
    replay_engine,
    replay_measured_together,
)
from asyncengine.sim.simulator import simulate
from asyncengine.workloads import WorkloadRequest, shared_prefix

VOCAB = 49152  # SmolLM2's


def workloads(num_requests: int, seed: int) -> dict[str, list[WorkloadRequest]]:
    """The two checked workloads: independent random lengths, and groups sharing a prefix (where
    the orderings differ); all requests queued at time 0."""
    groups = max(num_requests // 8, 1)
    return {
        "random lengths": check_workload(num_requests, seed=seed),
        "shared prefix": shared_prefix(
            groups, 8, vocab_size=VOCAB, prefix_len=256, output_len=24, seed=seed
        ),
    }


def _cell(row: MetricComparison) -> str:
    e = row.relative_error
    if math.isnan(e):
        return "-"
    flag = " **over**" if e > GOAL else ""
    return f"{e * 100:.1f}%{flag}"


def _value(row: MetricComparison) -> str:
    if row.unit == "s":
        return f"{row.measured * 1e3:.0f} ms" if row.measured < 10 else f"{row.measured:.2f} s"
    return f"{row.measured:.1f} {row.unit}"


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", help="auto: the engine's pick on this CPU")
    parser.add_argument("--policies", nargs="+", default=["fcfs", "lpm", "token-budget"])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--kv-cache-tokens", type=int, default=4096)
    parser.add_argument("--engine", action="store_true", help="also the AsyncEngine, wall clock")
    parser.add_argument("--out", required=True, help="directory for sim_vs_real.md/.json")
    args = parser.parse_args(argv)

    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        kv_cache_tokens=args.kv_cache_tokens,
        log_interval=0.0,
    )
    checked = workloads(args.num_requests, seed=0)
    calibration = workloads(args.num_requests, seed=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    # every run in lockstep: whatever loads the machine loads them all alike
    jobs = [(f"calibration: {w}", base, calibration[w]) for w in calibration]
    jobs += [
        (f"{w} / {p}", base.replace(policy=p), checked[w]) for w in checked for p in args.policies
    ]
    runs = replay_measured_together([j[1] for j in jobs], [j[2] for j in jobs])
    load_after = os.getloadavg()
    measured = dict(zip((j[0] for j in jobs), runs, strict=True))

    traces = []
    for i, w in enumerate(calibration):
        run = measured[f"calibration: {w}"]
        traces.append(write_measured_trace(
            out / f"calibration_{i}.trace.jsonl", calibration[w], run.plans, run.step_seconds,
            run.records, page_size=base.page_size, vocab_size=VOCAB,
        ))  # fmt: skip
    merged = out / "calibration.trace.jsonl"
    with merged.open("w", encoding="utf-8") as f:  # one trace file holding both runs' steps
        for i, path in enumerate(traces):
            lines = path.read_text(encoding="utf-8").splitlines()
            f.write("\n".join(lines if i == 0 else [ln for ln in lines if '"type":"step"' in ln]))
            f.write("\n")
            path.unlink()
    cost = CostModel.from_live_trace(merged)
    shipped = CostModel.default()

    result: dict[str, object] = {
        "cost_model": asdict(cost),
        "load_average_before_after": [load_before, load_after],
        "goal": GOAL,
        "runs": {},
    }
    header = "| workload / policy | real steps | simulated steps |"
    rule = "|---|---:|---:|"
    for name, _, _ in FIDELITY_METRICS:
        header += f" {name} real | error |"
        rule += "---:|---:|"
    lines = [header, rule]
    misses: list[str] = []
    worst = 0.0
    for label, config, workload in jobs:
        if label.startswith("calibration"):
            continue
        real = measured[label]
        sim = simulate(config, workload, cost)
        rows = fidelity(sim.summary, real.summary)
        shipped_rows = fidelity(simulate(config, workload, shipped).summary, real.summary)
        line = f"| {label} | {real.steps} | {sim.steps} |"
        for row in rows:
            line += f" {_value(row)} | {_cell(row)} |"
            if row.relative_error > GOAL:
                misses.append(f"{label}: {row.name} {row.relative_error:.1%}")
            if not math.isnan(row.relative_error):
                worst = max(worst, row.relative_error)
        lines.append(line)
        result["runs"][label] = {  # type: ignore[index]
            "real": real.summary.to_dict(),
            "simulated": sim.summary.to_dict(),
            "real_steps": real.steps,
            "simulated_steps": sim.steps,
            "errors": {row.name: row.relative_error for row in rows},
            "errors_shipped_cost_model": {row.name: row.relative_error for row in shipped_rows},
        }
    table = "\n".join(lines) + "\n"
    summary = f"Worst error {worst:.1%}; goal {GOAL:.0%} per metric: " + (
        "met everywhere." if not misses else "missed on " + "; ".join(misses) + "."
    )
    sections = [
        "### Fidelity: the simulator against the real executor (CPU clock)\n",
        f"Cost model fitted from the recorded calibration traces ({cost.description}): "
        f"{cost.intercept * 1e3:.1f} ms + {cost.per_prefill_token * 1e3:.3f} ms/prefill token + "
        f"{cost.per_prefill_attention * 1e6:.3f} us/prefill query-key + "
        f"{cost.per_decode_request * 1e3:.2f} ms/decode + "
        f"{cost.per_decode_context * 1e6:.2f} us/decoded KV token. Machine load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores; other jobs share them).\n",
        table,
        summary + "\n",
    ]
    if args.engine:
        workload = checked["random lengths"]
        engine = replay_engine(base, workload, torch_threads=1)
        rows = {
            "simulator, fitted": compare(simulate(base, workload, cost).summary, engine.summary)
        }
        result["engine_wall_clock"] = {
            "summary": engine.summary.to_dict(),
            "cpu_share": engine.cpu_share,
            "errors": {row.name: row.relative_error for row in rows["simulator, fitted"]},
        }
        sections += [
            "### random lengths / fcfs: the simulator against the AsyncEngine, wall clock\n",
            f"The engine process got {engine.cpu_share:.2f} CPU seconds per wall second.\n",
            markdown_comparison("AsyncEngine, wall clock", rows),
        ]
    (out / "sim_vs_real.md").write_text("\n".join(sections), encoding="utf-8")
    (out / "sim_vs_real.json").write_text(
        json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8"
    )
    print("\n".join(sections))
    return result


if __name__ == "__main__":
    run_main(main)
