"""Smoke runs of scripts/bench_offline.py and scripts/bench_serving.py on a tiny model.

Tiny sizes only: each run checks that the JSON it writes holds the expected fields with sane
values (every request done, token counts equal to the workload's, positive latencies).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from asyncengine.workloads import make_workload, save_trace
from tests.server_support import MAX_MODEL_LEN, engine_config, start_server, tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
SMALL_RANDOM = [
    "--workload-arg",
    "input_median=12",
    "--workload-arg",
    "output_median=6",
    "--workload-arg",
    "max_input_len=40",
    "--workload-arg",
    "max_output_len=10",
]


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"bench_script_{name}", ROOT / "scripts" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def offline() -> ModuleType:
    return load_script("bench_offline")


@pytest.fixture(scope="module")
def serving() -> ModuleType:
    return load_script("bench_serving")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def expected_output_tokens(**kwargs: Any) -> int:
    return sum(item.output_len for item in make_workload("random", **kwargs))


# -- bench_offline ---------------------------------------------------------------------------


def test_agreement_counts_identical_requests_and_common_prefixes(offline: ModuleType) -> None:
    ref = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    other = [[1, 2, 3, 4], [5, 0], [0, 8, 9, 10]]
    result = offline.agreement(ref, other)
    assert result.identical_fraction == pytest.approx(1 / 3)
    assert result.mean_prefix_fraction == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert result.min_prefix_fraction == 0.0
    with pytest.raises(ValueError):
        offline.agreement(ref, other[:2])


def test_padded_batches_group_similar_output_lengths(offline: ModuleType) -> None:
    workload = make_workload("random", num_requests=10, seed=3, vocab_size=100)
    batches = offline.padded_batches(workload, 4)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))
    longest_before = 0
    for batch in batches:  # every batch's lengths sit at or above the previous batch's
        lengths = [workload[i].output_len for i in batch]
        assert min(lengths) >= longest_before
        longest_before = max(lengths)


@pytest.mark.slow
def test_offline_compares_the_three_systems(
    offline: ModuleType, model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "offline.json"
    offline.main(
        [
            "--model", str(model_dir), "--dtype", "float32", "--num-requests", "6",
            "--seed", "1", "--batch-size", "4", "--hf-cb-max-batch-tokens", "256",
            "--engine-arg", f"max_model_len={MAX_MODEL_LEN}",
            "--out", str(out), "--no-progress", *SMALL_RANDOM,
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    expected = expected_output_tokens(
        num_requests=6, seed=1, vocab_size=49152, input_median=12, output_median=6,
        max_input_len=40, max_output_len=10,
    )  # fmt: skip
    assert result["mode"] == "systems"
    assert result["workload"]["output_tokens"] == expected
    assert set(result["runs"]) == {"asyncengine", "hf-padded", "hf-cb"}
    for name, run in result["runs"].items():
        assert run["output_tokens"] == expected, name
        assert run["seconds"] > 0 and run["cpu_seconds"] >= 0, name
        assert run["output_tokens_per_second"] == pytest.approx(expected / run["seconds"])
    assert result["runs"]["asyncengine"]["generated_tokens"] == expected
    assert result["runs"]["hf-cb"]["generated_tokens"] == expected
    assert result["runs"]["hf-padded"]["generated_tokens"] >= expected  # padding waste
    for name in ("hf-padded", "hf-cb"):
        agree = result["runs"][name]["greedy_agreement_with_asyncengine"]
        assert 0.0 <= agree["identical_fraction"] <= 1.0
        # float32, a handful of tokens: a broken padding or position would diverge at once
        assert agree["mean_prefix_fraction"] >= 0.5, (name, agree)
        assert result["runs"][name]["asyncengine_speedup"] > 0
    assert result["fastest_hf"] in ("hf-padded", "hf-cb")
    assert result["machine"]["cpu_count"] >= 1


def test_offline_shared_prefix_saves_prefill(
    offline: ModuleType, model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "prefix.json"
    offline.main(
        [
            "--model", str(model_dir), "--dtype", "float32", "--shared-prefix",
            "--num-groups", "2", "--questions-per-group", "3", "--prefix-len", "64",
            "--prefix-output-len", "3", "--engine-arg", f"max_model_len={MAX_MODEL_LEN}",
            # one prompt per prefill step: requests admitted together cannot share a prefix
            "--engine-arg", "max_prefill_tokens=128",
            "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    on, off = result["runs"]["radix-on"], result["runs"]["radix-off"]
    assert result["mode"] == "shared_prefix"
    assert on["output_tokens"] == off["output_tokens"] == 6 * 3
    assert off["hit_tokens"] == 0
    assert off["miss_tokens"] == result["prompt_tokens"]
    # later questions of a group find whole pages (16 tokens) of its prefix in the tree
    assert on["hit_tokens"] >= 16 and on["hit_tokens"] % 16 == 0
    assert result["prefill_tokens_saved"] == on["hit_tokens"]
    assert 0 < on["hit_tokens"] <= result["optimal_hit_tokens"]
    assert 0 < result["prefill_saved_fraction"] < 1
    assert result["speedup_radix_on_vs_off"] > 0


# -- bench_serving ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_url(model_dir: Path) -> Iterator[str]:
    """An in-process server on its own event loop thread, so the script can run asyncio.run."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(start_server(engine_config(model_dir)), loop).result(
        timeout=300
    )
    try:
        yield running.base_url
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def check_serving_result(result: dict[str, Any], num_requests: int, output_tokens: int) -> None:
    s = result["summary"]
    assert s["num_requests"] == num_requests
    assert s["num_completed"] == num_requests and s["num_failed"] == 0, result["errors"]
    assert result["errors"] == []
    assert s["output_tokens"] == output_tokens
    assert s["duration"] > 0 and s["output_throughput"] > 0
    for name in ("ttft", "e2e"):
        stats = s[name]
        assert stats["count"] == num_requests
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert s["ttft"]["max"] <= s["e2e"]["max"]
    assert s["itl"]["count"] > 0 and s["itl"]["p50"] >= 0
    assert 0.0 <= s["cache_hit_rate"] <= 1.0


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
def test_serving_against_a_running_server(
    serving: ModuleType, server_url: str, tmp_path: Path, endpoint: str
) -> None:
    out = tmp_path / "serving.json"
    serving.main(
        [
            "--base-url", server_url, "--endpoint", endpoint, "--workload", "random",
            "--num-requests", "5", "--seed", "2", "--request-rate", "50",
            "--request-timeout", "60", "--max-duration", "120", "--out", str(out),
            "--no-progress", *SMALL_RANDOM,
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    expected = expected_output_tokens(
        num_requests=5, seed=2, vocab_size=49152, input_median=12, output_median=6,
        max_input_len=40, max_output_len=10,
    )  # fmt: skip
    check_serving_result(result, 5, expected)
    assert result["endpoint"] == endpoint
    assert result["workload"]["arrivals"] == "poisson:50.0"
    metrics = result["server_metrics"]
    assert metrics["cache_miss_tokens"] > 0
    if endpoint == "generate":  # one arrival per token: the TPOT of every request is measured
        assert result["summary"]["itl"]["count"] == expected - 5


def test_serving_replays_a_trace_with_bounded_concurrency(
    serving: ModuleType, server_url: str, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    workload = make_workload(
        "shared_prefix", num_groups=1, questions_per_group=4, prefix_len=48, output_len=3,
        vocab_size=49152, seed=5,
    )  # fmt: skip
    save_trace(trace, workload)
    out = tmp_path / "trace.json"
    serving.main(
        [
            "--base-url", server_url, "--workload", str(trace), "--max-concurrency", "1",
            "--warmup", "0", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    check_serving_result(result, 4, 4 * 3)
    # one at a time behind one 48-token prefix: every request after the first hits 3 pages
    assert result["summary"]["cached_tokens"] >= 3 * 48
    assert result["max_concurrency"] == 1


def test_serving_counts_timeouts_as_failures(
    serving: ModuleType, server_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "timeouts.json"
    serving.main(
        [
            "--base-url", server_url, "--num-requests", "3", "--warmup", "0",
            "--workload-arg", "input_median=8", "--workload-arg", "max_input_len=40",
            "--workload-arg", "output_median=400",
            "--workload-arg", "max_output_len=400", "--request-timeout", "0.05",
            "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["summary"]["num_failed"] == 3
    assert result["summary"]["num_completed"] == 0
    assert all("Timeout" in e for e in result["errors"]), result["errors"]


def test_serving_refuses_non_loopback_servers(serving: ModuleType) -> None:
    with pytest.raises(SystemExit, match="loopback"):
        serving.main(["--base-url", "http://10.1.2.3:8000", "--num-requests", "1"])
    assert serving.check_loopback("http://localhost:9/") == "http://localhost:9"


@pytest.mark.slow
def test_serving_launches_and_stops_its_own_server(
    serving: ModuleType, model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "launch.json"
    serving.main(
        [
            "--launch", "--model", str(model_dir), "--workload", "long_short",
            "--num-requests", "4", "--workload-arg", "short_len=8", "--workload-arg",
            "long_factor=4", "--workload-arg", "output_len=4", "--startup-timeout", "300",
            "--server-log", str(tmp_path / "server.log"), "--out", str(out), "--no-progress",
            "--", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--chunked-prefill-size", "16", "--log-interval", "0", "--server-log-interval", "0",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    check_serving_result(result, 4, 4 * 4)
    assert result["workload"]["prompt_tokens"] == 3 * 8 + 32
    assert result["launch"]["exit_code"] == 0
    assert "--chunked-prefill-size" in result["launch"]["command"]
