"""The local lm-evaluation-harness task and scripts/bench_lm_eval.py: the committed data is what
its generator writes, and (slow) the harness scores a model through the server exactly as
through its own HF backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.test_bench_scripts import load_script
from tests.server_support import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "scripts" / "lm_eval_tasks"


def test_committed_task_data_is_what_its_generator_writes() -> None:
    make = load_script("lm_eval_tasks/make_asyncengine_mc")
    items = make.items()
    lines = (TASK_DIR / "asyncengine_mc" / "asyncengine_mc.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == items
    for item in items:
        assert 0 <= item["answer"] < len(item["choices"]) == 4
        assert len(set(item["choices"])) == 4


def test_request_loop_seconds_read_from_the_harness_progress_bar() -> None:
    bench = load_script("bench_lm_eval")
    log = (
        "Requesting API:  50%|#####     | 272/544 [00:12<00:12, 22.00it/s]\r"
        "Requesting API: 100%|##########| 544/544 [00:24<00:00, 22.59it/s]\n"
    )
    assert bench.request_seconds(log) == pytest.approx(544 / 22.59)
    slow = "Running loglikelihood requests: 100%|##########| 34/34 [1:02:03<00:00, 1.50s/it]\n"
    assert bench.request_seconds(slow) == pytest.approx(34 * 1.5)
    assert bench.request_seconds("Requesting API:  50%|#####     | 272/544 [00:12<00:12]") is None


@pytest.mark.slow
def test_lm_eval_scores_equal_through_the_server_and_hf(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = tiny_model_dir(tmp_path_factory, initializer_range=0.2)
    out = tmp_path / "lm_eval.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_lm_eval.py"),
            "--model",
            str(model),
            "--limit",
            "6",
            "--batch-size",
            "4",
            "--num-fewshot",  # contexts of whole pages the choices share: the score cache's case
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    ours, hf = report["runs"]
    assert ours["request_seconds"] > 0 and hf["request_seconds"] > 0
    assert report["equal_accuracy"] and (ours["acc"], ours["acc_norm"]) == (
        hf["acc"],
        hf["acc_norm"],
    )
    assert ours["samples"] == hf["samples"] == 6 and ours["requests"] == 24
    counters = report["server_counters"]
    assert counters["prompt_score_hit_positions"] > 0
    assert counters["cache_hit_tokens"] >= counters["prompt_score_hit_positions"]
