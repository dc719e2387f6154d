#!/usr/bin/env python
"""The cold adapters' TTFT under one hot adapter's flood, per policy, simulated or real.

    python scripts/lora_fairness.py --out results/lora_fairness.json
    python scripts/lora_fairness.py --per-cold 24 --seed 3 --set max_loras=4 --out f.json
    python scripts/lora_fairness.py --real --out results/lora_fairness_real.json   # ~15 min
    python scripts/lora_fairness.py --real --quick --runs lora-fair --out f.json   # ~2 min

One adapter ("hot") floods the engine; seven others ("cold-0" ..) send a few requests each
(asyncengine.workloads.adapters.hot_adapter_flood). Each policy runs the workload with the
flood and the cold requests alone; the table gives the cold adapters' p99 TTFT both ways and
their ratio (asyncengine/sim/lora_fairness.py). Prints a markdown table, writes JSON.

``--real`` runs the engine itself (the embedded model unless ``--set model=...``) on the wall
clock, one engine per run, with a random rank ``--rank`` adapter per name written by
scripts/make_lora.py; its defaults are a shorter flood (the simulator's would take an hour on
two cores), and the runs are fcfs and lora-fair (``--runs`` picks any of the table's rows).
``--quick`` sends a quarter of the requests at the same rates, for iterating. The JSON lists
every cold request of each row (its TTFT with the flood and alone, its wait, its retractions
and, real, the batch it was admitted into), to tell what its p99 is made of.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asyncengine.common.config import EngineConfig, key_value
from asyncengine.script_main import run_main
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.lora_fairness import (
    DEFAULT_RUNS,
    FAIRNESS_ENGINE,
    Outcome,
    Runner,
    fairness_table,
    lora_fairness,
    real,
    simulated,
)
from asyncengine.workloads.adapters import HOT_ADAPTER
from asyncengine.workloads.trace import WorkloadRequest

# (simulated, real): the real flood arrives at two thirds of the simulator's rate, still faster
# than a 2-core AVX-512 CPU serves the embedded model (at 4/s it kept up, and fcfs starved
# nobody), over the cold adapters' two minutes, so that a real run ends in about a quarter of an
# hour on two cores (13 min of runs in the simulator). The cold requests are the simulator's:
# fewer of them make the p99 one request's luck (the simulator gives lora-fair 1.3-1.6x with
# these over seeds 0-2, and 2-2.5x with 5-12 per cold adapter).
WORKLOAD_DEFAULTS = {
    "num_hot": (600, 960),
    "per_cold": (24, 24),
    "hot_rate": (12.0, 8.0),
    "cold_rate": (0.2, 0.2),
}
REAL_RUNS = ("fcfs", "lora-fair")
QUICK_SHARE = 4  # --quick: a quarter of the hot and cold requests
ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def write_adapters(model: str, names: Sequence[str], root: Path, rank: int, targets: str) -> dict:
    """A random PEFT adapter per name under ``root`` (kept when already there)."""
    from make_lora import base_model, random_adapter

    base = None
    paths = {}
    for seed, name in enumerate(names):
        path = root / name
        if not (path / "adapter_model.safetensors").is_file():
            base = base if base is not None else base_model(model)
            random_adapter(base, path, rank, targets.split(","), seed=seed)
        paths[name] = str(path)
    return paths


def announced(runner: Runner) -> Runner:
    """``runner``, saying how each run went (a real one takes minutes)."""

    def run(config: EngineConfig, workload: Sequence[WorkloadRequest]) -> Outcome:
        started = time.perf_counter()
        outcome = runner(config, workload)
        hot = sum(item.lora == HOT_ADAPTER for item in workload)
        print(
            f"[{config.policy}] {len(workload)} requests ({hot} of {HOT_ADAPTER}): "
            f"{outcome.seconds:.1f} s from the first arrival, {outcome.preemptions} preempted "
            f"({time.perf_counter() - started:.0f} s with start-up)",
            flush=True,
        )
        return outcome

    return run


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for key, (sim_default, real_default) in WORKLOAD_DEFAULTS.items():
        parser.add_argument(
            f"--{key.replace('_', '-')}",
            type=type(sim_default),
            default=None,
            help=f"default {sim_default} (--real: {real_default})",
        )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"1/{QUICK_SHARE} of the default hot and cold requests, at the same rates",
    )
    parser.add_argument("--num-cold", type=int, default=7, help="cold adapters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        nargs="*",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help=f"engine config over {FAIRNESS_ENGINE}",
    )
    parser.add_argument(
        "--runs",
        nargs="*",
        choices=[run.label for run in DEFAULT_RUNS],
        default=None,
        help=f"rows to run (default: all simulated, {', '.join(REAL_RUNS)} real)",
    )
    parser.add_argument("--cost-model", default=None, help="cost model JSON (default: shipped)")
    parser.add_argument("--real", action="store_true", help="run the real engine")
    parser.add_argument("--rank", type=int, default=16, help="--real: the adapters' rank")
    parser.add_argument("--targets", default=ALL_TARGETS, help="--real: the adapters' modules")
    parser.add_argument("--adapter-dir", type=Path, help="--real: keep the adapters here")
    parser.add_argument("--out", required=True, help="JSON to write")
    args = parser.parse_args(argv)
    started = time.time()
    workload = {
        key: getattr(args, key) if getattr(args, key) is not None else defaults[int(args.real)]
        for key, defaults in WORKLOAD_DEFAULTS.items()
    }
    if args.quick:
        for key in ("num_hot", "per_cold"):
            if getattr(args, key) is None:
                workload[key] = max(1, workload[key] // QUICK_SHARE)
    workload.update(num_cold=args.num_cold, seed=args.seed)
    labels = args.runs if args.runs is not None else (REAL_RUNS if args.real else None)
    runs = [run for run in DEFAULT_RUNS if labels is None or run.label in labels]
    engine = dict(args.set)
    with tempfile.TemporaryDirectory() as tmp:
        runner: Runner
        if args.real:
            names = [HOT_ADAPTER, *(f"cold-{j}" for j in range(args.num_cold))]
            model = str(engine.get("model", "smollm2-135m"))
            root = args.adapter_dir or Path(tmp)
            runner = announced(real(write_adapters(model, names, root, args.rank, args.targets)))
        else:
            runner = simulated(CostModel.load(args.cost_model) if args.cost_model else None)
        rows = lora_fairness(runs, engine=engine, runner=runner, **workload)
    table = fairness_table(rows)
    print(table)
    report = {
        "mode": "real engine" if args.real else "simulator",
        "engine": {**FAIRNESS_ENGINE, **engine},
        "workload": workload,
        "adapters": {"rank": args.rank, "targets": args.targets} if args.real else None,
        "rows": [row.to_dict() for row in rows],
        "command": " ".join(["scripts/lora_fairness.py", *(argv or sys.argv[1:])]),
        "seconds": time.time() - started,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return table


if __name__ == "__main__":
    run_main(main)
