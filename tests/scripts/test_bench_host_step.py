"""scripts/micro/bench_host_step.py: the engine over a stand-in executor, host time per step by part."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts.test_bench_scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("micro/bench_host_step")


def test_decode_and_mixed_steps_are_split_by_part(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "host.json"
    bench.main(["--batches", "4,256", "--output-len", "12", "--mixed-requests", "24",
                "--mixed-batch", "8", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    rows = {row["scenario"]: row for row in report["rows"]}
    assert set(rows) == {"decode B=4", "decode B=256", "mixed (24 req)"}
    # a decode scenario measures its steady steps: 12 tokens, the first from the prefill step,
    # then 11 decode steps of the whole batch, less the two at its edges
    assert rows["decode B=4"]["steps_measured"] == 9
    assert rows["decode B=4"]["mean_decodes"] == 4 and rows["decode B=4"]["mean_extend_tokens"] == 0
    assert rows["mixed (24 req)"]["mean_extend_tokens"] > 0
    for row in rows.values():
        parts = row["parts_ms"]
        for part in ("schedule + plan", "plan -> tensors", "sampling", bench.LAND,
                     bench.STREAM):  # fmt: skip
            assert parts[part] > 0, (row["scenario"], part)
        assert row["host_ms_per_step"] > 0 and row["cpu_ms_per_step"] > 0
    assert report["host_ms_per_step_256"] == rows["decode B=256"]["host_ms_per_step"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"host_ms_per_step {rows['decode B=256']['host_ms_per_step']:.3f}"


def test_the_stand_in_streams_ordinary_text_tokens(bench: ModuleType) -> None:
    from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
    from asyncengine.common.sampling_params import SamplingParams

    executor = bench.StandInExecutor(49152, (2,), width=64)
    from asyncengine.core.executor_api import KVLayout

    executor.bind(KVLayout(num_pages=64, page_size=4, max_rows=8, max_pages_per_row=8))
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    plan = BatchPlan(
        step=3,
        decodes=[Segment(f"r{i}", i, [1200 + i], 5, True) for i in range(3)],
        sampling=[SamplingInfo(greedy, [1], []) for _ in range(3)],
    )
    out = executor.execute(plan)
    assert len(out.token_ids) == 3
    assert all(bench.TOKEN_OFFSET <= t < bench.TOKEN_OFFSET + 64 for t in out.token_ids)


def test_with_overlap_the_steps_are_planned_ahead_of_the_device(
    bench: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "host.json"
    bench.main(["--batches", "8", "--output-len", "32", "--mixed-requests", "0",
                "--device-ms", "1.0", "--overlap", "--out", str(out)])  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["device_ms"] == 1.0
    assert row["planned_ahead"] == 1.0  # every steady decode step was planned during the last
    # the device runs one step at a time: steps come no faster than its 1 ms (a step's wall
    # runs from one plan to the next, and plans are made ahead, so single steps may be shorter)
    assert row["host_ms_mean"] >= 0.95
    assert row["wall_over_bound"] == row["host_ms_per_step"] / max(row["cpu_ms_per_step"], 1.0)


def test_the_stand_in_fills_in_deferred_inputs(bench: ModuleType) -> None:
    from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
    from asyncengine.common.sampling_params import SamplingParams
    from asyncengine.core.executor_api import KVLayout

    executor = bench.StandInExecutor(49152, (2,), width=64)
    executor.bind(KVLayout(num_pages=64, page_size=4, max_rows=8, max_pages_per_row=8))
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    sampling = [SamplingInfo(greedy, [1], []) for _ in range(2)]
    first = BatchPlan(step=1, decodes=[Segment(f"r{i}", i, [1200], 5, True) for i in range(2)])
    first.sampling = sampling
    sampled = executor.execute(first).token_ids
    ahead = BatchPlan(step=2, decodes=[Segment(f"r{i}", i, [-1], 6, True) for i in range(2)])
    ahead.sampling, ahead.deferred = sampling, [0, 1]
    batch = executor._prepare(ahead)
    assert batch.input_ids.tolist() == sampled


def test_before_measures_another_checkout_scenario_by_scenario(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkout = Path(__file__).resolve().parents[2]  # this checkout as its own "before"
    out = tmp_path / "host.json"
    bench.main(["--batches", "4", "--output-len", "8", "--mixed-requests", "0",
                "--before", str(checkout), "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    (before,) = report["before"]["rows"]
    (after,) = report["rows"]
    assert before["scenario"] == after["scenario"] == "decode B=4"
    assert before["mean_decodes"] == after["mean_decodes"] == 4
    assert before["cpu_ms_per_step"] > 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("before: "))
    row = lines[at + 2].split()  # the header, then the scenario's row
    assert row[:2] == ["decode", "B=4"]
    assert float(row[2]) == pytest.approx(before["cpu_ms_per_step"], abs=1e-3)
    assert float(row[3]) == pytest.approx(after["cpu_ms_per_step"], abs=1e-3)
