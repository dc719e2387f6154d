"""compare_policies on the adapter workloads (per-adapter tables), and the fairness table."""

from __future__ import annotations

import json
from pathlib import Path

from tests.scripts.test_compare_policies import load_script


def test_compare_policies_runs_an_adapter_workload_grouped_by_adapter(tmp_path: Path) -> None:
    compare = load_script("compare_policies")
    out = tmp_path / "out"
    runs = compare.main(
        [
            "--policies", "fcfs", "lora-fair", "lpm",
            "--set", "max_loras=2",
            "--workload", "adapter_mix",
            "--workload-arg", "num_requests=60", "num_adapters=5", "rate=30.0",
            "--group-by", "lora",
            "--no-figures",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert [run.label for run in runs] == ["fcfs", "lora-fair", "lpm"]
    assert all(run.summary.num_completed == 60 for run in runs)
    text = (out / "results.md").read_text()
    by_adapter = text.split("## By lora")[1]
    assert all(f"lora lora-{i}" in by_adapter for i in range(5))
    assert "lora_slots" in text  # two slots for five adapters: admission passed some over
    details = json.loads((out / "summary.json").read_text())
    assert all(d["scheduler_stats"]["lora_loads"] >= 5 for d in details.values())


def test_lora_fairness_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    script = load_script("lora_fairness")
    out = tmp_path / "fair.json"
    table = script.main(["--num-hot", "150", "--per-cold", "4", "--out", str(out)])
    assert "| fcfs |" in table and "| lora-fair |" in table
    report = json.loads(out.read_text())
    assert report["engine"]["max_loras"] == 8
    rows = {row["label"]: row for row in report["rows"]}
    assert set(rows) == {"fcfs", "lora-fair", "lora-fair, preempt = false"}
    for row in rows.values():
        assert row["ratio"] == row["cold_p99_flood"] / row["cold_p99_alone"]
    # every cold request, by arrival, with its times with the flood and alone
    cold = rows["lora-fair"]["cold_requests"]
    assert len(cold) == 7 * 4 and all(item["adapter"] != "hot" for item in cold)
    assert [item["arrival"] for item in cold] == sorted(item["arrival"] for item in cold)
    ttfts = sorted(item["ttft"] for item in cold)
    assert rows["lora-fair"]["cold_p99_flood"] <= ttfts[-1]
    assert all(item["ttft_alone"] > 0 and 0 <= item["queue_time"] <= item["ttft"] for item in cold)
    assert all(item["admitted_into"] is None for item in cold)  # the simulator logs no steps


def test_lora_fairness_quick_sends_a_quarter_of_the_requests(tmp_path: Path) -> None:
    script = load_script("lora_fairness")
    out = tmp_path / "quick.json"
    script.main(["--quick", "--per-cold", "8", "--runs", "fcfs", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["workload"]["num_hot"] == 600 // 4  # the simulator's default, a quarter
    assert report["workload"]["per_cold"] == 8  # given: kept
    assert len(report["rows"][0]["cold_requests"]) == 7 * 8
