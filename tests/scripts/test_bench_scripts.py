"""Smoke runs of scripts/bench_offline.py and scripts/bench_serving.py on a tiny model.

Tiny sizes only: each run checks that the JSON it writes holds the expected fields with sane
values (every request done, token counts equal to the workload's, positive latencies).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from asyncengine.workloads import make_workload, save_trace
from tests.server_support import MAX_MODEL_LEN, engine_config, start_server, tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
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
def systems(offline: ModuleType) -> ModuleType:
    """scripts/systems.py as the benchmarks import it (one module, shared by the three)."""
    return importlib.import_module("systems")


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
            # 128 tokens a prefill step: questions of a group come in later steps and find its
            # prefix in the tree, or in the same step (in-step sharing)
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
    # later questions of a group find its prefix in the tree (whole pages) or take it from a
    # question of the same step (in-step sharing: to the token)
    assert on["hit_tokens"] >= 16
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


@pytest.mark.slow
def test_short_beside_long_launches_a_server_per_lane_and_reports_each(
    model_dir: Path, tmp_path: Path
) -> None:
    bench = load_script("bench_short_beside_long")
    out = tmp_path / "short_long.json"
    result = bench.main(
        [
            "--lanes", "0,8", "--long-len", "200", "--short-len", "4", "--num-short", "2",
            "--short-delay", "0.05", "--short-interval", "0.05", "--output-len", "2",
            "--repeats", "1", "--out", str(out),
            "--", "--model", str(model_dir), "--dtype", "float32", "--max-model-len",
            str(MAX_MODEL_LEN), "--chunked-prefill-size", "16", "--log-interval", "0",
        ]
    )  # fmt: skip
    assert json.loads(out.read_text())["medians"] == result["medians"]
    for lane in ("0", "8"):
        (run,) = result["runs"][lane]
        assert 0 < run["short_ttft_p50"] <= run["short_ttft_max"] < run["wall_seconds"]
        assert 0 < run["long_ttft"] < run["wall_seconds"]


# -- vLLM as a peer: the parts that need no vLLM (CI has no vLLM virtualenv) ----------------

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # head_dim = 32 / 4 = 8
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    """A model directory holding only config.json (what the KV sizing reads)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return folder


@pytest.fixture
def single_stream() -> ModuleType:
    return load_script("bench_single_stream")


def small_workload(n: int = 5) -> list[Any]:
    return make_workload(
        "random", num_requests=n, seed=4, vocab_size=64, input_median=6, output_median=4,
        max_input_len=12, max_output_len=8,
    )  # fmt: skip


def test_vllm_spec_carries_the_same_requests_and_our_pool_in_bytes(
    offline: ModuleType, config_dir: Path
) -> None:
    from asyncengine.common.config import EngineConfig

    workload = small_workload()
    config = EngineConfig(model=str(config_dir))
    spec = offline.VllmSystem.spec(config, workload, config_dir, "bfloat16")
    assert spec["model"] == str(config_dir) and spec["dtype"] == "bfloat16"
    assert [r["prompt_ids"] for r in spec["requests"]] == [w.prompt_ids for w in workload]
    assert [r["output_len"] for r in spec["requests"]] == [w.output_len for w in workload]
    per_token = 2 * 3 * 2 * 8 * 2  # K and V x layers x kv heads x head_dim x bf16 bytes
    assert spec["kv_cache_bytes"] == 32768 * per_token  # the engine's default CPU pool
    assert json.loads(json.dumps(spec)) == spec  # what gets written is plain JSON

    fp32 = offline.VllmSystem.spec(config, workload, config_dir, "float32")
    assert fp32["kv_cache_bytes"] == 2 * spec["kv_cache_bytes"]
    # a pool of 100 tokens is 7 pages of 16: vLLM gets room for the same 112 tokens
    small = offline.VllmSystem.spec(
        EngineConfig(model=str(config_dir), kv_cache_tokens=100),
        workload,
        config_dir,
        "bfloat16",
        [("max_num_seqs", 64), ("enforce_eager", True), ("swap_space", 0)],
    )
    assert small["kv_cache_bytes"] == 112 * per_token
    assert small["max_num_seqs"] == 64 and small["enforce_eager"] is True
    assert small["llm_kwargs"] == {"swap_space": 0}  # unknown to vllm_peer: for vllm.LLM
    given = offline.VllmSystem.spec(
        config, workload, config_dir, "bfloat16", [("kv_cache_gib", 1.5)]
    )
    assert given["kv_cache_gib"] == 1.5 and "kv_cache_bytes" not in given


def test_kv_bytes_per_token_reads_head_dim_from_the_config(
    offline: ModuleType, config_dir: Path
) -> None:
    peer = offline.peer_vllm
    assert peer.kv_bytes_per_token(config_dir, "float32") == 2 * 3 * 2 * 8 * 4
    (config_dir / "config.json").write_text(json.dumps({**TINY_LLAMA_CONFIG, "head_dim": 16}))
    assert peer.kv_bytes_per_token(config_dir, "bfloat16") == 2 * 3 * 2 * 16 * 2
    with pytest.raises(ValueError, match="dtype"):
        peer.kv_bytes_per_token(config_dir, "int8")


def peer_result(workload: list[Any], **changes: Any) -> dict[str, Any]:
    """A result shaped like vllm_peer.py's offline result (same keys)."""
    result = {
        "system": "vllm", "vllm_version": "0.32.0", "mode": "offline",
        "seconds": 4.0, "cpu_seconds": 7.5, "main_process_cpu_seconds": 1.0,
        "startup_seconds": 35.5, "warmup_seconds": 0.2, "load_start": 1.5, "load_end": 2.5,
        "foreign_cpu_fraction": 0.04, "peak_tree_rss_bytes": 3_900_000_000,
        "peak_tree_pss_bytes": 3_000_000_000,
        "output_tokens": sum(w.output_len for w in workload),
        "engine": {"max_num_seqs": 256, "block_size": 128, "kv_cache_tokens": 32768},
        "token_ids": [[5] * w.output_len for w in workload],
    }  # fmt: skip
    return {**result, **changes}


def test_a_vllm_result_becomes_a_row_beside_asyncengine(
    offline: ModuleType, systems: ModuleType
) -> None:
    import argparse

    workload = small_workload()
    useful = sum(w.output_len for w in workload)
    vllm = offline.VllmSystem.offline_run(peer_result(workload), workload)
    row = vllm.to_json()
    assert row["system"] == "vllm" and row["seconds"] == 4.0 and row["cpu_seconds"] == 7.5
    assert row["output_tokens"] == useful == row["generated_tokens"]
    assert row["output_tokens_per_second"] == pytest.approx(useful / 4.0)
    assert row["startup_seconds"] == 35.5 and row["peak_rss_bytes"] == 3_900_000_000
    assert row["engine_config"]["max_num_seqs"] == 256
    assert row["load_average_start_end"] == [1.5, 2.5]

    # asyncengine twice as fast, agreeing on all but the first request's first token
    ours = [[5] * w.output_len for w in workload]
    ours[0] = [6] + ours[0][1:]
    engine = offline.SystemRun(
        "asyncengine", systems.Timing(2.0, 5.0, 1.0, 1.0), useful, useful, ours,
        {"startup_seconds": 2.0, "peak_rss_bytes": 1_500_000_000},
    )  # fmt: skip
    args = argparse.Namespace(seed=4, workload_arg=[])
    result = offline.systems_result({"asyncengine": engine, "vllm": vllm}, workload, args)
    result["dtype"] = "bfloat16"
    assert result["speedup_vs_vllm"] == pytest.approx(2.0)
    assert result["speedup_vs_vllm_cpu_time"] == pytest.approx(7.5 / 5.0)
    assert "fastest_hf" not in result  # vLLM is not an HF mode
    agree = result["runs"]["vllm"]["greedy_agreement_with_asyncengine"]
    assert agree["identical_fraction"] == pytest.approx(4 / 5)
    text = offline.table(result)
    assert "asyncengine ahead of vLLM by 2.00x" in text
    assert "| vllm | 4.0 | 7.5 |" in text and "| 35.5 | 3.90 |" in text
    assert "max_num_seqs=256" in text

    slower = offline.VllmSystem.offline_run(peer_result(workload, seconds=1.0), workload)
    result = offline.systems_result({"asyncengine": engine, "vllm": slower}, workload, args)
    result["dtype"] = "bfloat16"
    assert "asyncengine behind vLLM: 0.50x" in offline.table(result)


def test_a_vllm_result_that_does_not_match_the_requests_is_refused(offline: ModuleType) -> None:
    workload = small_workload()
    short = [[5] * w.output_len for w in workload]
    short[2] = short[2][:-1]
    with pytest.raises(offline.peer_vllm.VllmPeerError, match="request 2"):
        offline.VllmSystem.offline_run(peer_result(workload, token_ids=short), workload)
    with pytest.raises(offline.peer_vllm.VllmPeerError, match="4 outputs for 5"):
        offline.VllmSystem.offline_run(peer_result(workload, token_ids=short[:4]), workload)
    with pytest.raises(offline.peer_vllm.VllmPeerError, match="token_ids"):
        offline.VllmSystem.offline_run(peer_result(workload, token_ids=None), workload)


def test_foreign_cpu_is_the_machines_busy_time_less_our_own(systems: ModuleType) -> None:
    import os

    cpus = os.cpu_count() or 1
    assert systems.foreign_fraction(3.0, 1.0, 2.0) == pytest.approx(2.0 / (2.0 * cpus))
    assert systems.foreign_fraction(1.0, 1.5, 2.0) == 0.0  # clock ticks vs process time
    assert math.isnan(systems.foreign_fraction(1.0, 0.5, 0.0))
    with systems.timed() as timing:
        sum(range(10_000))
    assert timing.seconds >= 0 and timing.cpu_seconds >= 0
    assert math.isnan(timing.foreign_cpu_fraction) or 0.0 <= timing.foreign_cpu_fraction <= 1.0


def test_systems_take_commas_or_spaces(offline: ModuleType) -> None:
    args = offline.build_parser().parse_args(["--systems", "asyncengine,vllm", "hf-cb"])
    assert [n for group in args.systems for n in group] == ["asyncengine", "vllm", "hf-cb"]
    with pytest.raises(SystemExit):
        offline.build_parser().parse_args(["--systems", "asyncengine,sglang"])


def test_a_missing_vllm_venv_is_named_with_its_fix(
    offline: ModuleType,
    serving: ModuleType,
    single_stream: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    empty = tmp_path / "no-venv"
    empty.mkdir()
    monkeypatch.setenv("VLLM_VENV", str(empty))
    fix = "run scripts/setup_vllm_cpu.sh"
    with pytest.raises(offline.peer_vllm.VllmUnavailableError, match=fix):
        offline.peer_vllm.require_vllm_venv()
    with pytest.raises(offline.peer_vllm.VllmUnavailableError, match=fix):
        offline.peer_vllm.run_peer(["--print-env"], 5, tmp_path / "peer.log")
    # every script refuses before any engine starts
    for main, argv in (
        (offline.main, ["--systems", "asyncengine,vllm", "--dtype", "float32"]),
        (single_stream.main, ["--systems", "vllm", "--dtype", "float32"]),
        (serving.main, ["--systems", "vllm", "--dtype", "float32", "--request-rate", "1"]),
    ):
        with pytest.raises(SystemExit, match=fix):
            main(argv)
    # and the shell wrapper says the same
    import subprocess

    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "peers" / "vllm" / "run.sh"), "--print-env"],
        capture_output=True, text=True, timeout=30,
        env={"PATH": "/usr/bin:/bin", "VLLM_VENV": str(empty)},
    )  # fmt: skip
    assert done.returncode == 2 and "setup_vllm_cpu.sh" in done.stderr


FAKE_PEER = """
import json, sys
args = sys.argv[2:]  # argv[1] is peers/vllm/runner.py
if "--sleep" in args:
    import subprocess, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # an engine child
    time.sleep(300)
spec = json.load(open(args[0]))
out = args[args.index("--out") + 1]
json.dump({
    "seconds": 2.0, "cpu_seconds": 3.0, "startup_seconds": 1.0, "load_start": 0.5,
    "load_end": 0.5, "peak_tree_rss_bytes": 1000, "engine": {"kv_bytes": spec["kv_cache_bytes"]},
    "token_ids": [[1] * r["output_len"] for r in spec["requests"]],
}, open(out, "w"))
"""


@pytest.fixture
def fake_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 'vLLM venv' whose python answers like peers/vllm/runner.py, to drive the real plumbing."""
    venv = tmp_path / "fake-venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "fake_peer.py").write_text(FAKE_PEER)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake_peer.py"} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("VLLM_VENV", str(venv))
    return venv


def test_run_vllm_writes_the_spec_runs_the_peer_and_reads_it_back(
    offline: ModuleType, config_dir: Path, fake_venv: Path, tmp_path: Path
) -> None:
    from asyncengine.common.config import EngineConfig

    workload = small_workload()
    config = EngineConfig(model=str(config_dir), kv_cache_tokens=64)
    run = offline.VllmSystem(60, tmp_path / "w").run_offline(
        config, workload, "float32", [("max_num_seqs", 8)]
    )
    assert run.outputs == [[1] * w.output_len for w in workload]
    assert run.tokens_per_second == pytest.approx(sum(w.output_len for w in workload) / 2.0)
    spec = json.loads((tmp_path / "w" / "vllm_spec.json").read_text())
    assert spec["max_num_seqs"] == 8 and spec["dtype"] == "float32"
    assert (
        spec["kv_cache_bytes"] == 64 * 2 * 3 * 2 * 8 * 4 == run.extra["engine_config"]["kv_bytes"]
    )
    assert run.extra["kv_cache"]["asyncengine_pool_tokens"] == 64


def test_a_peer_past_its_time_is_stopped_with_its_children(
    offline: ModuleType, fake_venv: Path, tmp_path: Path
) -> None:
    import subprocess

    peer = offline.peer_vllm
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def spy(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = real_popen(*args, **kwargs)
        started.append(process)
        return process

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(peer.subprocess, "Popen", spy)
        with pytest.raises(peer.VllmPeerError, match="did not finish within 1 s"):
            peer.run_peer(["--sleep"], 1.0, tmp_path / "peer.log")
    assert len(started) == 1
    assert started[0].poll() is not None
    assert not peer.group_alive(started[0].pid)  # the 'engine child' went too


def test_vllm_peer_mirror_of_the_random_workload_matches_ours() -> None:
    """vllm_peer.py --make-random draws asyncengine's random workload without importing it."""
    import argparse

    peer = load_script("peers/vllm/runner")
    args = argparse.Namespace(
        make_random=6, model=None, dtype="bfloat16", vocab_size=64, seed=3, input_median=20.0,
        input_sigma=1.0, output_median=9.0, output_sigma=0.9, max_input_len=2048,
        max_output_len=1024,
    )  # fmt: skip
    spec = peer.make_random(args)
    ours = make_workload(
        "random", num_requests=6, seed=3, vocab_size=64, input_median=20, output_median=9
    )
    assert [r["prompt_ids"] for r in spec["requests"]] == [w.prompt_ids for w in ours]
    assert [r["output_len"] for r in spec["requests"]] == [w.output_len for w in ours]


# -- bench_single_stream: the bound's arithmetic ---------------------------------------------


def test_copy_bandwidth_counts_reads_and_writes_over_the_median(
    single_stream: ModuleType, systems: ModuleType
) -> None:
    bw = single_stream.copy_bandwidth(1000, [4.0, 1.0, 2.0])
    assert bw.bytes_per_second == pytest.approx(2 * 1000 / 2.0)
    with pytest.raises(ValueError):
        single_stream.copy_bandwidth(1000, [])
    assert single_stream.bound_tokens_per_second(10e9, 250_000_000) == pytest.approx(40.0)
    assert systems.decode_tokens_per_second(33, [0.1, 0.3, 0.2], [1.2, 3.0, 1.7]) == pytest.approx(
        32 / 1.5
    )


def test_weight_bytes_count_a_tied_head_once(single_stream: ModuleType, tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    embed = np.zeros((64, 32), np.float32)
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed.copy(),
        "model.layers.0.mlp.up_proj.weight": np.zeros((48, 32), np.float32),
        "model.norm.weight": np.zeros(32, np.float32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    tied = single_stream.weight_bytes(tmp_path, "bfloat16")
    assert tied["parameters"] == 64 * 32 + 48 * 32 + 32
    assert tied["bytes"] == 2 * tied["parameters"] and tied["tied_embeddings_counted_once"]
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY_LLAMA_CONFIG, "tie_word_embeddings": False})
    )
    untied = single_stream.weight_bytes(tmp_path, "float32")
    assert untied["parameters"] == tied["parameters"] + 64 * 32
    assert untied["bytes"] == 4 * untied["parameters"]


def single_stream_result(rates: dict[str, float]) -> dict[str, Any]:
    """A bench_single_stream result whose systems decoded at ``rates`` tok/s (bound 40)."""
    rows = {
        name: {"decode_tokens_per_second": tps, "first_token_seconds": [0.05],
               "full_seconds": [1.0], "startup_seconds": 1.0, "peak_rss_bytes": 10**9}
        for name, tps in rates.items()
    }  # fmt: skip
    return {
        "dtype": "bfloat16",
        "bound_tokens_per_second": 40.0,
        "bandwidth": {"gb_per_second": 10.0, "seconds": [0.1] * 3, "tensor_bytes": 512 << 20},
        "weights": {"bytes": 250_000_000, "parameters": 125_000_000,
                    "tied_embeddings_counted_once": True},
        "runs": rows,
    }  # fmt: skip


def test_single_stream_fractions_and_table(single_stream: ModuleType) -> None:
    result = single_stream_result({"asyncengine": 20.0, "vllm": 10.0})
    single_stream.add_fractions(result)
    assert result["runs"]["asyncengine"]["fraction_of_bound"] == pytest.approx(0.5)
    assert result["runs"]["vllm"]["fraction_of_bound"] == pytest.approx(0.25)
    assert result["speedup_vs_vllm"] == pytest.approx(2.0)
    text = single_stream.table(result)
    assert "| asyncengine | 20.0 | 50.00 | 50.0 | 50.0% |" in text
    assert "= 40.0 tok/s" in text and "ahead of vLLM by 2.00x" in text


def test_single_stream_gives_no_ratio_to_a_peer_without_a_decode_rate(
    single_stream: ModuleType,
) -> None:
    """On busy cores a peer's one-token request can take longer than its whole request: no
    decode rate (nan), so no ratio rather than 'nanx its speed'."""
    result = single_stream_result({"asyncengine": 20.0, "llamacpp": math.nan})
    single_stream.add_fractions(result)
    assert "speedup_vs_llamacpp" not in result
    text = single_stream.table(result)
    assert "| llamacpp | - |" in text and "nan" not in text


def test_single_stream_cpu_time_per_token(single_stream: ModuleType) -> None:
    result = {"repeats": 3, "output_len": 127}
    # each repeat generates 1 + 127 tokens: 3.84 CPU seconds over 384 tokens
    assert single_stream.cpu_ms_per_token({"cpu_seconds": 3.84}, result) == pytest.approx(10.0)
    assert single_stream.cpu_ms_per_token({}, result) is None


def test_single_stream_prompt_is_vllm_peers(single_stream: ModuleType) -> None:
    import numpy as np

    prompt = single_stream.single_stream_prompt(49152, 16, 0)
    assert prompt == np.random.default_rng(0).integers(0, 49152, size=16).tolist()
    assert len(prompt) == 16 and all(0 <= t < 49152 for t in prompt)


# -- bench_serving: rate sweeps and vLLM's launch --------------------------------------------


def sweep_row(rate: float, p99: float | None, failed: int = 0) -> dict[str, Any]:
    return {
        "rate": rate,
        "summary": {
            "num_completed": 8 - failed, "num_failed": failed, "request_throughput": rate,
            "output_throughput": 10.0 * rate,
            "ttft": {"p50": None if p99 is None else p99 / 2, "p99": p99},
            "itl": {"p50": 0.05, "p99": 0.1},
        },
    }  # fmt: skip


def test_max_rate_under_the_ttft_slo(serving: ModuleType) -> None:
    rows = [sweep_row(4, 2.5), sweep_row(1, 0.3), sweep_row(2, 1.9), sweep_row(8, 1.0)]
    # 8 req/s passes again, but 4 already failed: the answer is the rate before the first miss
    assert serving.max_rate_under_slo(rows, 2.0) == 2
    assert serving.max_rate_under_slo(rows, 3.0) == 8
    assert serving.max_rate_under_slo([sweep_row(1, 2.5)], 2.0) is None
    assert serving.max_rate_under_slo([sweep_row(1, 0.1, failed=1)], 2.0) is None
    assert serving.max_rate_under_slo([sweep_row(1, None)], 2.0) is None
    summary = serving.system_summary([sweep_row(1, 0.3), sweep_row(2, 0.5)], 2.0)
    assert summary["max_rate_under_ttft_slo"] == 2 and summary["slo_held_at_every_rate"]


def test_rates_and_systems_parsing(serving: ModuleType, systems: ModuleType) -> None:
    assert serving.parse_rates("4, 1,2,2") == [1.0, 2.0, 4.0]
    for bad in ("", "0,1", "a,b"):
        with pytest.raises(SystemExit):
            serving.parse_rates(bad)
    assert serving.systems_list(["asyncengine,vllm"]) == ["asyncengine", "vllm"]
    with pytest.raises(SystemExit, match="choose from"):
        serving.systems_list(["tgi"])
    assert systems.vllm_flags([("max_num_seqs", 128), ("enforce_eager", True)]) == [
        "--max-num-seqs", "128", "--enforce-eager",
    ]  # fmt: skip
    assert systems.vllm_flags([("enable_prefix_caching", False)]) == ["--no-enable-prefix-caching"]
    assert serving.serve_flag(["--dtype", "x", "--kv-cache-tokens=99"], "--kv-cache-tokens") == "99"
    with pytest.raises(SystemExit, match="exactly one"):
        serving.main(["--systems", "asyncengine", "--base-url", "http://127.0.0.1:1"])
    with pytest.raises(SystemExit, match="completions"):
        serving.main(["--systems", "asyncengine", "--endpoint", "generate"])
    with pytest.raises(SystemExit, match="replaces"):
        serving.main(["--launch", "--rates", "1,2", "--request-rate", "3"])


def test_with_arrivals_copies_the_requests(serving: ModuleType) -> None:
    workload = small_workload(4)
    paced = serving.with_arrivals(workload, "poisson:2", 0)
    assert [w.prompt_ids for w in paced] == [w.prompt_ids for w in workload]
    assert paced[0].arrival_time == 0.0 and paced[-1].arrival_time > 0
    assert all(w.arrival_time == 0.0 for w in workload)  # the originals stay as they were


def test_sweep_table_compares_systems_at_each_rate(serving: ModuleType) -> None:
    systems = {
        "asyncengine": serving.system_summary([sweep_row(1, 0.2), sweep_row(2, 0.4)], 2.0),
        "vllm": serving.system_summary([sweep_row(1, 0.4), sweep_row(2, 2.4)], 2.0),
    }
    comparison = serving.compare_at_rates(systems)
    assert comparison[0]["ttft_p50_vllm_over_asyncengine"] == pytest.approx(2.0)
    assert comparison[1]["ttft_p99_vllm_over_asyncengine"] == pytest.approx(6.0)
    result = {"ttft_slo_seconds": 2.0, "systems": systems, "comparison": comparison}
    text = serving.sweep_table(result)
    assert "asyncengine: TTFT p99 <= 2 s at every rate tried, up to 2 req/s" in text
    assert "vllm: TTFT p99 <= 2 s up to 1 req/s" in text
    assert text.index("| 1 | asyncengine |") < text.index("| 1 | vllm |") < text.index("| 2 |")


def test_serving_sweeps_rates_against_a_running_server(
    serving: ModuleType, server_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "sweep.json"
    serving.main(
        [
            "--base-url", server_url, "--endpoint", "completions", "--num-requests", "4",
            "--rates", "40,20", "--seed", "2", "--request-timeout", "60", "--max-duration", "120",
            "--label", "tiny", "--out", str(out), "--no-progress", *SMALL_RANDOM,
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["mode"] == "sweep"
    runs = result["systems"]["tiny"]["runs"]
    assert [r["rate"] for r in runs] == [20.0, 40.0]
    # each rate draws its own requests (seed 2, then 3): no prefix cache hits across rates
    assert [p["seed"] for p in result["workload"]["per_point"]] == [2, 3]
    for seed, row in zip((2, 3), runs, strict=True):
        expected = expected_output_tokens(
            num_requests=4, seed=seed, vocab_size=49152, input_median=12, output_median=6,
            max_input_len=40, max_output_len=10,
        )  # fmt: skip
        check_serving_result(row, 4, expected)
    assert result["systems"]["tiny"]["max_rate_under_ttft_slo"] in (None, 20.0, 40.0)


# -- the llama.cpp peer: which GGUF holds the weights asyncengine runs --------------------------


def test_the_llamacpp_peer_runs_the_weights_asyncengine_runs() -> None:
    peer = load_script("peers/llamacpp/launcher")
    # the default (quantization "auto") keeps the embedded Q4_1 file as stored: so does the peer
    assert peer.model_kind_for("smollm2-135m", "auto", "float32") == "q4_1"
    # expanded weights: the conversion of the run's dtype
    assert peer.model_kind_for("smollm2-135m", "none", "float32") == "float32"
    assert peer.model_kind_for("smollm2-135m", "none", "bfloat16") == "bfloat16"
    assert peer.model_kind_for("/some/model-dir", "auto", "float32") == "float32"
    with pytest.raises(peer.LlamaCppPeerError):
        peer.model_kind_for("smollm2-135m", "none", "auto")


def test_our_cpu_kernels_are_built_before_any_timing(
    systems: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """build_cpu_kernels compiles (or finds cached) every build an engine's pool may load, in a
    process of its own, so that no start-up figure counts gcc; nothing for peers alone or a GPU."""
    from asyncengine.kernels.cpu import cpu_native, decode_step_native

    ran: list[list[str]] = []
    real_run = systems.subprocess.run

    def spy(command: list[str], **kwargs: Any) -> Any:
        ran.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(systems.subprocess, "run", spy)
    systems.build_cpu_kernels(["llamacpp"])
    systems.build_cpu_kernels(["asyncengine"], "cuda")
    assert ran == []
    systems.build_cpu_kernels(["asyncengine", "llamacpp"])
    assert len(ran) == 1
    builds = [(path.stem, ()) for path in cpu_native.SOURCE_DIR.glob("*.c")]
    for kv_dtype, flags in decode_step_native.KV_BUILD_FLAGS.items():
        builds += [(name, cpu_native.kv_flags(kv_dtype)) for name in cpu_native.KV_LIBRARIES]
        builds.append(("cpu_decode_step", flags))
    assert all(cpu_native.library_path(name, flags).exists() for name, flags in builds)
