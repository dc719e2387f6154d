"""The fairness table on the real engine: a small flood of one adapter over two cold ones, with
real adapters, and the records' adapter names that the table splits on."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.sim.lora_fairness import (
    DEFAULT_RUNS,
    Outcome,
    fairness_table,
    lora_fairness,
    real,
    simulated,
)
from asyncengine.workloads.adapters import HOT_ADAPTER, hot_adapter_flood
from asyncengine.workloads.trace import WorkloadRequest
from tests.executor.lora_support import fresh_hf_model, make_lora_script
from tests.server_support import tiny_model_dir

WORKLOAD = {
    "num_hot": 12,
    "num_cold": 2,
    "per_cold": 2,
    "hot_rate": 40.0,
    "cold_rate": 10.0,
    "input_median": 24.0,
    "output_median": 4.0,
    "vocab_size": 200,
    "seed": 1,
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    model_dir = tiny_model_dir(tmp_path_factory)
    root = tmp_path_factory.mktemp("fairness_loras")
    script = make_lora_script()
    paths = {}
    for seed, name in enumerate([HOT_ADAPTER, "cold-0", "cold-1"]):
        script.random_adapter(fresh_hf_model(model_dir), root / name, 4, ("q_proj",), seed=seed)
        paths[name] = str(root / name)
    return model_dir, paths


def test_the_real_engine_runs_the_table_with_each_record_under_its_adapter(
    adapters: tuple[Path, dict[str, str]],
) -> None:
    model_dir, paths = adapters
    seen: list[Outcome] = []
    runner = real(paths)

    def spy(config: EngineConfig, workload: Sequence[WorkloadRequest]) -> Outcome:
        outcome = runner(config, workload)
        seen.append(outcome)
        return outcome

    engine = {"model": str(model_dir), "dtype": "float32", "page_size": 16}
    runs = [run for run in DEFAULT_RUNS if run.label in ("fcfs", "lora-fair")]
    rows = lora_fairness(runs, engine=engine, runner=spy, **WORKLOAD)
    assert [row.label for row in rows] == ["fcfs", "lora-fair"]
    assert len(seen) == 4  # each policy: with the flood, alone
    flood = hot_adapter_flood(include_hot=True, **WORKLOAD)
    by_rid = {item.rid: item.lora for item in flood}
    for outcome in seen[::2]:
        assert {r.rid: r.lora for r in outcome.records} == by_rid
        assert all(r.completed for r in outcome.records) and outcome.seconds > 0
    for row in rows:
        assert row.cold_p99_alone > 0 and row.cold_p99_flood > 0 and row.hot_output_throughput > 0
    assert "| lora-fair |" in fairness_table(rows)
    # each cold request with the step it was admitted into, from the run's step log
    records = {r.rid: r for r in seen[2].records}
    steps = seen[2].steps
    assert steps is not None
    for item in rows[1].cold_requests:
        record = records[item["rid"]]
        assert item["ttft"] == round(record.ttft, 4) and item["adapter"] == record.lora
        batch = item["admitted_into"]
        admitted = steps.first_extend(item["rid"])
        assert admitted is not None and batch["step"] == admitted.step
        assert item["rid"] in {rid for rid, _ in admitted.extends}
        assert batch["prefills"] >= 1 and batch["prefill_tokens"] >= 1 and batch["adapters"] >= 1
        # admitted after it arrived and by its first token, on the records' clock (the engine
        # stamps its arrival a little after the replay does)
        assert record.arrival_time <= batch["landed"] <= record.arrival_time + record.ttft + 0.05


def test_a_runner_whose_records_do_not_name_the_adapter_is_refused() -> None:
    """Records without their adapter would count the flood's requests as cold ones."""
    sim = simulated()

    def forgetful(config: EngineConfig, workload: Sequence[WorkloadRequest]) -> Outcome:
        outcome = sim(config, workload)
        for record in outcome.records:
            record.lora = None
        return outcome

    with pytest.raises(RuntimeError, match="not naming their request's adapter"):
        lora_fairness(DEFAULT_RUNS[:1], runner=forgetful, **WORKLOAD)


def test_the_real_runner_refuses_a_workload_naming_an_adapter_it_lacks() -> None:
    runner = real({"cold-0": "/nowhere"})
    workload = hot_adapter_flood(include_hot=True, **WORKLOAD)
    with pytest.raises(ValueError, match="no adapter directory for cold-1, hot"):
        runner(EngineConfig(), workload)
