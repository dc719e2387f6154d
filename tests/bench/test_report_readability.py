"""What a reader of compare_policies' output is told: units that fit the scale, why rows
coincide, how a shadow policy agreed (results.md and stdout, not only summary.json)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncengine.bench.records import RequestRecord, summarize
from asyncengine.bench.report import RunReport, _ms, queue_hint, shadow_table
from tests.scripts.test_bench_scripts import load_script

SMALL = [
    "--workload", "shared_prefix",
    "--workload-arg", "num_groups=2", "questions_per_group=3", "prefix_len=32",
    "vocab_size=300", "output_len=4",
    "--no-figures",
]  # fmt: skip
SETTINGS = ["--set", "page_size=4", "kv_cache_tokens=512", "max_model_len=512"]


def run(
    label: str, ttft: float, peak: int | None, shadow: dict[str, object] | None = None
) -> RunReport:
    record = RequestRecord(label, 0.0, 8, token_times=[ttft, ttft + 0.1], finish_time=ttft + 0.1)
    summary = summarize([record])
    return RunReport(label, "fcfs", summary, [record], math.nan, shadow=shadow, peak_waiting=peak)


def test_latencies_read_in_seconds_past_ten_seconds() -> None:
    assert _ms(0.25) == "250.0 ms"
    assert _ms(9.9994) == "9999.4 ms"
    assert _ms(10.0) == "10.00 s"
    assert _ms(312.456) == "312.46 s"
    assert _ms(math.nan) == "-"


def test_the_hint_says_the_queue_never_held_enough_to_reorder() -> None:
    hint = queue_hint([run("a", 1.0, 1), run("b", 1.0, 1)])
    assert "never held more than 1 request " in hint
    busy = queue_hint([run("a", 1.0, 9), run("b", 2.0, 7)])
    assert busy == ""
    same = queue_hint([run("a", 1.0, 3), run("b", 1.0, 2)])
    assert same.startswith("The rows are identical") and "more than 3 requests" in same
    assert queue_hint([run("a", 1.0, None), run("b", 1.0, None)]) == ""  # real runs: unknown


def test_the_shadow_table_reports_agreement() -> None:
    shadow = {"policy": "lpm", "top_k": 4, "decisions": 20, "first_pick_agreement": 0.25,
              "top_k_agreement": 0.5}  # fmt: skip
    table = shadow_table([run("fcfs-shadow", 1.0, 4, shadow), run("plain", 1.0, 4)])
    assert "| fcfs-shadow | `fcfs` | `lpm` | 20 | 25.0% | 50.0% (top 4) |" in table
    assert "plain" not in table
    assert shadow_table([run("plain", 1.0, 4)]) == ""


def test_compare_policies_prints_the_hint_and_the_shadow_agreement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    compare = load_script("compare_policies")
    compare.main([*SMALL, *SETTINGS, "--arrivals", "interval:30", "--policies", "fcfs", "lpm",
                  "--out", str(tmp_path / "idle")])  # fmt: skip
    idle = (tmp_path / "idle" / "results.md").read_text()
    assert "The rows are identical: the waiting queue never held more than 1 request" in idle
    assert "never held more than" in capsys.readouterr().out
    compare.main([*SMALL, "--arrivals", "burst", "--policies", "fcfs",
                  *SETTINGS, "shadow_policy=lpm", "--out", str(tmp_path / "shadow")])  # fmt: skip
    results = (tmp_path / "shadow" / "results.md").read_text()
    assert "## Shadow policy agreement" in results and "| fcfs | `fcfs` | `lpm` |" in results
    assert "Shadow policy agreement" in capsys.readouterr().out
    assert "never held more than" not in results  # a single run: nothing to compare


def test_the_report_counts_the_steps_a_policy_held_the_engine_idle(tmp_path: Path) -> None:
    compare = load_script("compare_policies")
    holds = "tests.sim.test_simulator:HoldUntilFiveSaysSo"  # admits nothing before t = 5 s
    compare.main([*SMALL, *SETTINGS, "--arrivals", "burst", "--policies", "fcfs", holds,
                  "--out", str(tmp_path)])  # fmt: skip
    results = (tmp_path / "results.md").read_text()
    table = results.split("## Why admission stopped (steps, by reason)")[1]
    header = table.strip().splitlines()[0]
    assert header.endswith("| policy_idle_holds | policy_idle_seconds |")
    assert "| fcfs |" in table and table.count("| 0 | 0.00 |") == 1  # fcfs never held
    # labelled by its class's name; one jump to its wake time
    assert "| HoldUntilFiveSaysSo |" in table and "| 1 | 5.00 |" in table
