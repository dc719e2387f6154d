#!/usr/bin/env python
"""Does the simulator predict a real run? The documented check of docs/EXPERIMENTS.md.

The shipped cost model and one calibrated on real steps, against the real executor on a
CPU-time clock, and against the real AsyncEngine on the wall clock:

    python scripts/sim_check.py --out docs/experiments/sim_vs_real
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncengine.config import EngineConfig
from asyncengine.script_main import run_main
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.sim_vs_real import (
    MeasuredRun,
    check_workload,
    compare,
    markdown_comparison,
    replay_engine,
    replay_measured_together,
)
from asyncengine.sim.simulator import simulate


def _step_fit(run: MeasuredRun, cost: CostModel) -> dict[str, float]:
    """How the cost model's per-step predictions compare with the measured steps."""
    predicted = [cost.time_of(f) for f in run.step_features]
    ratios = sorted(m / p for m, p in zip(run.step_seconds, predicted, strict=True))
    largest = max(range(run.steps), key=lambda i: run.step_seconds[i])
    return {
        "steps": run.steps,
        "measured_seconds": sum(run.step_seconds),
        "predicted_seconds": sum(predicted),
        "median_measured_over_predicted": ratios[len(ratios) // 2],
        "largest_step_measured": run.step_seconds[largest],
        "largest_step_predicted": predicted[largest],
        "largest_step_prompts": len(run.plans[largest].extends),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto: the engine's pick (on CPU the faster of bf16 and fp32)",
    )
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--prefill-budget",
        type=int,
        default=512,
        help="max_prefill_tokens = chunked_prefill_size of the budgeted scenario",
    )
    parser.add_argument("--cost-model", default=None, help="JSON (default: the shipped one)")
    parser.add_argument("--skip-engine", action="store_true", help="no AsyncEngine run")
    parser.add_argument("--out", required=True, help="directory for sim_vs_real.md/.json")
    args = parser.parse_args(argv)

    base = EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", policy=args.policy, log_interval=0.0
    )
    budgeted = base.replace(
        max_prefill_tokens=args.prefill_budget, chunked_prefill_size=args.prefill_budget
    )
    workload = check_workload(args.num_requests)
    calibration = [check_workload(args.num_requests, seed=seed) for seed in (1, 2)]
    shipped = CostModel.load(args.cost_model) if args.cost_model else CostModel.default()
    torch.set_num_threads(1)
    # calibration and checked runs in lockstep: the machine's load cannot differ between them
    *calibration_runs, checked_budgeted, checked_defaults = replay_measured_together(
        [budgeted, budgeted, budgeted, base], [*calibration, workload, workload]
    )
    calibrated = CostModel.fit(
        [f for run in calibration_runs for f in run.step_features],
        [t for run in calibration_runs for t in run.step_seconds],
        description="fitted on the real executor's measured steps (CPU clock) of two "
        f"calibration workloads (seeds 1 and 2), prefill budget {args.prefill_budget}",
    )
    models = {"simulator, shipped cost model": shipped, "simulator, calibrated": calibrated}
    result: dict[str, object] = {
        "workload": {
            "requests": len(workload),
            "prompt_tokens": sum(len(w.prompt_ids) for w in workload),
            "output_tokens": sum(w.output_len for w in workload),
            "arrivals": "all at 0",
        },
        "cost_models": {name: asdict(model) for name, model in models.items()},
    }
    sections: list[str] = []
    scenarios = [
        (f"prefill budget {args.prefill_budget}", budgeted, checked_budgeted),
        ("engine defaults (prefill budget 4096)", base, checked_defaults),
    ]
    for name, config, run in scenarios:
        simulations = {label: simulate(config, workload, model) for label, model in models.items()}
        rows = {label: compare(sim.summary, run.summary) for label, sim in simulations.items()}
        steps = _step_fit(run, shipped)
        result[name] = {
            "cpu_clock_replay": run.summary.to_dict(),
            "step_fit_of_the_shipped_model": steps,
            **{
                label: {
                    "summary": sim.summary.to_dict(),
                    "steps": sim.steps,
                    "errors": {row.name: row.relative_error for row in rows[label]},
                }
                for label, sim in simulations.items()
            },
        }
        sections += [
            f"### {name}: simulator vs the real executor on a CPU-time clock\n",
            f"{run.steps} real steps, {', '.join(str(s.steps) for s in simulations.values())} "
            f"simulated; the same plans measured {steps['measured_seconds']:.2f} s, the shipped "
            f"model predicts {steps['predicted_seconds']:.2f} s (largest step, "
            f"{steps['largest_step_prompts']} prompts: {steps['largest_step_measured']:.2f} s "
            f"measured, {steps['largest_step_predicted']:.2f} s predicted).\n",
            markdown_comparison("real, CPU clock", rows),
        ]
    if not args.skip_engine:
        engine = replay_engine(budgeted, workload, torch_threads=1)
        rows = {
            label: compare(simulate(budgeted, workload, model).summary, engine.summary)
            for label, model in models.items()
        }
        result["engine_wall_clock"] = {
            "summary": engine.summary.to_dict(),
            "wall_seconds": engine.wall_seconds,
            "cpu_seconds": engine.cpu_seconds,
            "cpu_share": engine.cpu_share,
        }
        sections += [
            f"### prefill budget {args.prefill_budget}: simulator vs the real AsyncEngine "
            "on the wall clock\n",
            f"The engine process got {engine.cpu_share:.2f} CPU seconds per wall second "
            f"(one torch thread; {engine.cpu_seconds:.1f} s CPU in {engine.wall_seconds:.1f} s).\n",
            markdown_comparison("AsyncEngine, wall clock", rows),
        ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_vs_real.md").write_text("\n".join(sections), encoding="utf-8")
    (out / "sim_vs_real.json").write_text(
        json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8"
    )
    print("\n".join(sections))
    return result


if __name__ == "__main__":
    run_main(main)
