"""scripts/make_real_models.py's shapes and scripts/bench_real_sizes.py on a tiny shape (ours
only: no llama.cpp needed), and its report's arithmetic on a result with both systems."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.scripts.test_bench_scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_real_sizes")


@pytest.fixture(scope="module")
def make_models(bench: ModuleType) -> ModuleType:
    import make_real_models  # type: ignore[import-not-found]  # scripts/, on the path bench set

    return make_real_models


def test_named_shapes_have_the_real_models_parameter_counts(make_models: ModuleType) -> None:
    billions = {name: shape.parameters / 1e9 for name, shape in make_models.SHAPES.items()}
    assert billions["llama-3.2-1b"] == pytest.approx(1.236, abs=0.001)
    assert billions["llama-3.2-3b"] == pytest.approx(3.213, abs=0.001)
    assert billions["qwen2.5-1.5b"] == pytest.approx(1.544, abs=0.001)
    assert make_models.SHAPES["qwen2.5-0.5b"].parameters == 494_032_768
    assert billions["qwen3-1.7b"] == pytest.approx(1.721, abs=0.001)
    assert billions["llama-3.1-8b"] == pytest.approx(8.030, abs=0.001)
    # Gemma 3 1B's layers; with its own 262,144-token vocabulary, its exact count
    gemma = make_models.SHAPES["gemma-3-1b"]
    assert dataclasses.replace(gemma, vocab_size=262144).parameters == 999_885_952
    assert make_models.SHAPES["gemma-2-2b"].parameters == 2_614_341_888  # Gemma 2 2B's


def test_tiny_shape_runs_end_to_end_and_writes_its_json(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "cache"))
    # not every pool's kernel builds again into tmp_path (test_bench_scripts tests that step; the
    # switch ASYNCENGINE_NATIVE_KERNELS=0 would leave this process's cached libraries off)
    monkeypatch.setattr(bench, "build_cpu_kernels", lambda systems: None)
    out = tmp_path / "real_sizes.json"
    result = bench.main(
        [
            "--systems", "asyncengine", "--models", "tiny-llama", "--formats", "hf",
            "--repeats", "2", "--output-len", "48", "--concurrency", "2", "4",
            "--concurrent-prompt-len", "12", "--concurrent-output-len", "6",
            "--prefill-lens", "40", "--read-probe-mib", "16",
            "--out", str(out),
        ]
    )  # fmt: skip
    written = json.loads(out.read_text())
    assert written["command"] == result["command"]
    (entry,) = written["entries"]
    assert (entry["model"], entry["format"]) == ("tiny-llama", "hf")
    model_dir = Path(entry["path"])
    assert model_dir.is_relative_to(tmp_path / "cache" / "models")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 4
    # the bound: every parameter in bfloat16 (untied: embedding and LM head both read)
    assert entry["weights"]["bytes"] == 2 * entry["weights"]["parameters"]
    assert entry["weights"]["parameters"] == bench.models.SHAPES["tiny-llama"].parameters
    (system,) = entry["runs"]
    row = entry["runs"][system]
    assert system == "asyncengine"
    assert len(row["stream_full_seconds"]) == 2
    assert set(row["concurrent_output_tokens_per_second"]) == {"2", "4"}
    assert set(row["prefill_tokens_per_second"]) == {"40"}
    figures = [
        row["decode_tokens_per_second"],
        *row["concurrent_output_tokens_per_second"].values(),
        *row["prefill_tokens_per_second"].values(),
        row["startup_seconds"],
        entry["bound_tokens_per_second"],
    ]
    assert all(isinstance(v, float) and v > 0 and math.isfinite(v) for v in figures), figures
    # the bound: the read rate probed before each repeat (two probes), over the bytes of a step
    reads = row["stream_read_bytes_per_second"]
    assert len(reads) == 2 and all(r > 0 for r in reads)
    step = entry["weights"]["bytes"]
    assert entry["bound_tokens_per_second"] == pytest.approx(statistics.median(reads) / step)
    fractions = [
        47 / (full - first) / (read / step)
        for first, full, read in zip(
            row["stream_first_token_seconds"], row["stream_full_seconds"], reads, strict=True
        )
    ]
    assert row["fraction_of_bound"] == pytest.approx(statistics.median(fractions))


def _row(
    stream: float,
    conc: dict[str, float],
    prefill: dict[str, float],
    startup: float,
    reads: tuple[float, ...] = (20e9, 20e9, 20e9),
) -> Any:
    """A run's figures; its stream's three repeats each 128 tokens at ``stream`` tok/s after a
    0.1-s first token, each after a read-rate probe of ``reads``."""
    return {
        "decode_tokens_per_second": stream,
        "concurrent_output_tokens_per_second": conc,
        "prefill_tokens_per_second": prefill,
        "startup_seconds": startup,
        "stream_first_token_seconds": [0.1] * len(reads),
        "stream_full_seconds": [0.1 + 127 / stream] * len(reads),
        "stream_read_bytes_per_second": list(reads),
    }


def test_bounds_ratios_and_table_with_both_systems(bench: ModuleType) -> None:
    result = {
        "plan": {
            "concurrency": [8, 32],
            "prefill_lens": [512],
            "prompt_len": 16,
            "output_len": 128,
            "concurrent_prompt_len": 64,
            "concurrent_output_len": 64,
            "repeats": 3,
        },
        "entries": [
            {
                "model": "llama-3.2-1b",
                "format": "Q4_K_M",
                "weights": {"bytes": 800_000_000},
                "runs": {
                    "asyncengine": _row(
                        20.0, {"8": 80.0, "32": 150.0}, {"512": 300.0}, 3.0, (20e9, 40e9, 20e9)
                    ),
                    "llamacpp repacked": _row(16.0, {"8": 40.0, "32": 30.0}, {"512": 150.0}, 2.5),
                    "llamacpp as-stored": _row(12.0, {"8": 20.0, "32": 50.0}, {"512": 200.0}, 2.0),
                },
            }
        ],
    }
    bench.add_bounds(result)
    (entry,) = result["entries"]
    assert entry["bound_tokens_per_second"] == pytest.approx(25.0)  # the median probe: 20 GB/s
    # each repeat against its own probe: 0.8, 0.4, 0.8
    assert entry["runs"]["asyncengine"]["fraction_of_bound"] == pytest.approx(0.8)
    assert entry["runs"]["llamacpp repacked"]["fraction_of_bound"] == pytest.approx(0.64)
    # each figure against llama.cpp's faster mode: the stream and 8 at once repacked, the rest
    # as stored; start-up against its quicker start
    assert entry["ours_over_llamacpp"] == pytest.approx(
        {
            "stream": 1.25,
            "concurrent_8": 2.0,
            "concurrent_32": 3.0,
            "prefill_512": 1.5,
            "startup": 1.5,
        }
    )
    text = bench.table(result)
    assert "| llama-3.2-1b | Q4_K_M | asyncengine | 20.0 | 80% | 80.0 | 150.0 | 300 | 3.0 |" in text
    assert (
        "| llama-3.2-1b | Q4_K_M | llamacpp as-stored | 12.0 | 48% | 20.0 | 50.0 | 200 | 2.0 |"
        in text
    )
    assert (
        "| llama-3.2-1b | Q4_K_M | **ours / llama.cpp's best** | 1.25x |  | 2.00x | 3.00x | 1.50x"
        " | 1.50x |" in text
    )
    assert "(20-40 GB/s)" in text


def test_bad_options_are_refused(bench: ModuleType) -> None:
    with pytest.raises(SystemExit, match="choose from"):
        bench.main(["--systems", "vllm", "--models", "tiny-llama"])
    with pytest.raises(SystemExit, match="positive"):
        bench.main(["--systems", "asyncengine", "--concurrency", "0"])


def test_context_holds_the_concurrent_requests_without_a_prefill(bench: ModuleType) -> None:
    """With no prefill lengths the concurrent requests still fit their prompt and output."""
    plan = bench.Plan(
        prompt_len=16,
        output_len=16,
        repeats=1,
        concurrency=(32,),
        concurrent_prompt_len=64,
        concurrent_output_len=64,
        prefill_lens=(),
        seed=0,
    )
    assert plan.context == 64 + 64 + 1


def test_interleaved_ratio_replaces_the_ratio_of_medians(bench: ModuleType) -> None:
    result = {
        "plan": {"output_len": 128},
        "entries": [
            {
                "weights": {"bytes": 800_000_000},
                "runs": {
                    "asyncengine": _row(20.0, {"32": 150.0}, {}, 3.0),
                    "llamacpp repacked": _row(16.0, {"32": 50.0}, {}, 2.0),
                },
                "interleaved_concurrent": {"ratio_median_of_repeats": {"32": 2.5}},
            }
        ],
    }
    bench.add_bounds(result)
    assert result["entries"][0]["ours_over_llamacpp"]["concurrent_32"] == 2.5


def test_interleaved_concurrent_times_all_in_turn(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ours and a server per llama.cpp mode each repeat, who goes first rotating; the ratio is the
    median of the repeats' ratios against llama.cpp's faster mode in each repeat."""
    import asyncio

    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "cache"))
    path = bench.models.make("tiny-llama", ["hf"])["hf"]
    import time

    timed_calls: list[tuple[str, float]] = []
    # llama.cpp's seconds, repeat by repeat, per mode
    theirs = {"repacked": [4.0, 1.0, 9.0], "as-stored": [2.0, 3.0, 5.0]}
    walls = {mode: iter(values) for mode, values in theirs.items()}
    stopped: list[str] = []

    class FakeServer:
        def __init__(self, gguf: Path, parallel: int, extra_args: tuple[str, ...], **_: Any):
            assert parallel == 3
            self.mode = "as-stored" if "--no-repack" in extra_args else "repacked"

        def __enter__(self) -> FakeServer:
            return self

        def __exit__(self, *_: object) -> None:
            stopped.append(self.mode)

    async def run_requests(server: FakeServer, requests: list[Any]) -> tuple[list[Any], float]:
        assert len(requests) == 3
        if all(n == 2 for _, n in requests):  # the warm-up
            return [], 0.0
        assert all(n == 5 for _, n in requests)
        timed_calls.append((server.mode, time.perf_counter()))
        return [], next(walls[server.mode])

    monkeypatch.setattr(bench.peer_llamacpp, "LlamaServer", FakeServer)
    monkeypatch.setattr(bench.peer_llamacpp, "run_requests", run_requests)
    plan = bench.Plan(
        prompt_len=8, output_len=8, repeats=3, concurrency=(3,), concurrent_prompt_len=10,
        concurrent_output_len=5, prefill_lens=(), seed=0,
    )  # fmt: skip
    config = bench.engine_config(path, plan, [])
    modes = ("repacked", "as-stored")
    timed = asyncio.run(bench.interleaved_concurrent(config, path, plan, 1000, None, (), modes))
    ours = timed["seconds"]["asyncengine"]["3"]
    assert timed["seconds"]["llamacpp repacked"]["3"] == theirs["repacked"]
    assert timed["seconds"]["llamacpp as-stored"]["3"] == theirs["as-stored"]
    assert len(ours) == 3 and all(s > 0 for s in ours)
    assert sorted(stopped) == ["as-stored", "repacked"]
    # turns: ours, repacked, as-stored | repacked, as-stored, ours | as-stored, ours, repacked
    order = [mode for mode, _ in timed_calls]
    assert order == ["repacked", "as-stored"] * 2 + ["as-stored", "repacked"]
    at = [t for _, t in timed_calls]
    assert at[1] - at[0] < min(ours)  # back to back after ours
    assert at[4] - at[3] >= ours[1]  # ours last in the 2nd repeat, then as-stored first
    assert at[5] - at[4] >= ours[2]
    best = [min(r, s) for r, s in zip(theirs["repacked"], theirs["as-stored"], strict=True)]
    expected = sorted(t / o for o, t in zip(ours, best, strict=True))[1]
    assert timed["ratio_median_of_repeats"]["3"] == pytest.approx(expected)
    assert timed["ratio_by_mode"] == {
        mode: {"3": pytest.approx(sorted(t / o for o, t in zip(ours, v, strict=True))[1])}
        for mode, v in theirs.items()
    }


def test_startup_only_times_a_stream_at_start_and_a_settled_one(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--startup-only starts ours in a process of its own (startup_probe.py); after the two
    one-token requests a stream right away and one once the deferred work is done."""
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ASYNCENGINE_NATIVE_KERNELS", "0")  # not compiled again into tmp_path
    result = bench.main(
        [
            "--startup-only", "--systems", "asyncengine", "--models", "tiny-llama",
            "--formats", "hf", "--repeats", "1", "--output-len", "8",
        ]
    )  # fmt: skip
    (entry,) = result["entries"]
    row = entry["runs"]["asyncengine"]
    (start,) = row["starts"]
    for key in ("stream_at_start", "stream_settled"):
        assert start[f"{key}_seconds"] > start["second_request_seconds"] > 0
        rate = 7 / (start[f"{key}_seconds"] - start["second_request_seconds"])
        assert row[f"{key}_tokens_per_second"] == pytest.approx(rate)
    assert "stream at start tok/s" in bench.startup_table(result)


def test_startup_table_sets_the_streams_side_by_side(bench: ModuleType) -> None:
    def start(load: float, at_start: float, settled: float) -> dict[str, float]:
        row = {
            "interpreter_seconds": 0.1, "imports_seconds": 1.0, "load_seconds": load,
            "process_to_ready_seconds": load + 1.1, "first_request_seconds": 0.3,
            "second_request_seconds": 0.2, "stream_at_start_seconds": 0.2 + 127 / at_start,
            "stream_settled_seconds": 0.2 + 127 / settled,
        }  # fmt: skip
        return bench.add_stream_rates(row, 128)

    ours = start(1.0, 40.0, 50.0)
    repacked, as_stored = start(2.0, 40.0, 40.0), start(0.8, 32.0, 32.0)
    assert ours["stream_at_start_tokens_per_second"] == pytest.approx(40.0)
    runs = {"asyncengine": ours, "llamacpp repacked": repacked, "llamacpp as-stored": as_stored}
    result = {
        "plan": {"repeats": 1, "prompt_len": 16, "output_len": 128},
        "entries": [{"model": "m", "format": "Q4_K_M", "runs": runs}],
    }
    text = bench.startup_table(result)
    assert (
        "| m | Q4_K_M | asyncengine | 0.10 | 1.00 | 1.00 | 2.10 | 0.300 | 0.200 | 40.0 | 50.0 |"
        in text
    )
    # each figure against llama.cpp's best: the load against its quicker start (as stored), the
    # streams against its faster decode (repacked)
    assert text.splitlines()[5] == (
        "| m | Q4_K_M | **ours / llama.cpp's best** |  |  | 1.25x | 1.11x | 1.00x |  | 1.00x"
        " | 1.25x |"
    )
    assert "a stream of 128 tokens" in text
