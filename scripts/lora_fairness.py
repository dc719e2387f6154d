#!/usr/bin/env python
"""The cold adapters' TTFT under one hot adapter's flood, per policy, in the simulator.

    python scripts/lora_fairness.py --out results/lora_fairness.json
    python scripts/lora_fairness.py --per-cold 24 --seed 3 --set max_loras=4 --out f.json

One adapter ("hot") floods the engine; seven others ("cold-0" ..) send a few requests each
(asyncengine.workloads.adapters.hot_adapter_flood). Each policy runs the workload with the
flood and the cold requests alone; the table gives the cold adapters' p99 TTFT both ways and
their ratio (asyncengine/sim/lora_fairness.py). Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.common.config import key_value
from asyncengine.script_main import run_main
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.lora_fairness import FAIRNESS_ENGINE, fairness_table, lora_fairness


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-hot", type=int, default=600, help="the hot adapter's requests")
    parser.add_argument("--per-cold", type=int, default=24, help="requests of each cold adapter")
    parser.add_argument("--hot-rate", type=float, default=12.0, help="the hot adapter's req/s")
    parser.add_argument("--cold-rate", type=float, default=0.2, help="each cold adapter's req/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        nargs="*",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help=f"engine config over {FAIRNESS_ENGINE}",
    )
    parser.add_argument("--cost-model", default=None, help="cost model JSON (default: shipped)")
    parser.add_argument("--out", required=True, help="JSON to write")
    args = parser.parse_args(argv)
    cost = CostModel.load(args.cost_model) if args.cost_model else None
    engine = dict(args.set)
    rows = lora_fairness(
        engine=engine,
        cost_model=cost,
        num_hot=args.num_hot,
        per_cold=args.per_cold,
        hot_rate=args.hot_rate,
        cold_rate=args.cold_rate,
        seed=args.seed,
    )
    table = fairness_table(rows)
    print(table)
    report = {
        "engine": {**FAIRNESS_ENGINE, **engine},
        "workload": {
            "num_hot": args.num_hot,
            "per_cold": args.per_cold,
            "hot_rate": args.hot_rate,
            "cold_rate": args.cold_rate,
            "seed": args.seed,
        },
        "rows": [row.to_dict() for row in rows],
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return table


if __name__ == "__main__":
    run_main(main)
