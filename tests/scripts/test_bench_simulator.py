"""scripts/bench_simulator.py: per-policy simulate times as a table and JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_simulator.py"


@pytest.fixture(scope="module")
def bench_simulator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_script_bench_simulator", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_bench_simulator_times_each_policy_and_writes_json(
    bench_simulator: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    timings = bench_simulator.main(
        [
            "--num-requests",
            "40",
            "--policies",
            "fcfs",
            "lpm",
            "dfs-weight",
            "--arrivals",
            "poisson:4",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    assert [t.policy for t in timings] == ["fcfs", "lpm", "dfs-weight"]
    report = json.loads(out.read_text())
    assert report["num_requests"] == 40 and report["arrivals"] == "poisson:4"
    for row in report["timings"]:
        assert row["completed"] == 40 and len(row["cpu_seconds"]) == 2
        assert row["median_cpu"] > 0 and row["steps"] > 0
    table = capsys.readouterr().out
    assert all(name in table for name in ("fcfs", "lpm", "dfs-weight"))


def test_bench_simulator_refuses_zero_repeats(bench_simulator: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench_simulator.main(["--num-requests", "5", "--repeats", "0"])
