"""scripts/bench_stream_formats.py's arithmetic (medians that skip failed llama-bench runs, each
run's share of the bound measured before it, ours over llama.cpp's faster mode) and its table, on
a made-up result; its read probe; its refusals."""

from __future__ import annotations

import math
from types import ModuleType

import pytest

from tests.scripts.test_bench_scripts import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_stream_formats")


def test_medians_bound_and_ratio_against_the_faster_llamacpp_mode(bench: ModuleType) -> None:
    entry = {
        "model": "llama-3.2-1b",
        "format": "Q8_0",
        "weights": {"bytes": 1_000_000_000},
        "rounds": {
            "asyncengine": [20.0, 24.0, 22.0],
            "llamacpp repacked": [18.0, math.nan, 20.0],  # a failed run is left out
            "llamacpp as-stored": [10.0, 11.0, 12.0],
            "load": [1.0, 2.0, 3.0],
            # each run's bound: the read rate measured just before it (a slow second round)
            "read_bytes_per_second": {
                "asyncengine": [25e9, 40e9, 25e9],
                "llamacpp repacked": [25e9, 40e9, 20e9],
                "llamacpp as-stored": [50e9, 50e9, 50e9],
            },
        },
    }
    bench.summarize(entry, ["repacked", "as-stored"])
    assert entry["medians"]["asyncengine"] == 22.0
    assert entry["medians"]["llamacpp repacked"] == 19.0
    assert entry["medians"]["load"] == 2.0
    assert entry["medians"]["read_gb_per_second"] == pytest.approx(40.0)  # of all nine
    shares = entry["fractions_of_bound"]
    assert shares["asyncengine"] == pytest.approx(0.8)  # of 0.8, 0.6, 0.88
    assert shares["llamacpp repacked"] == pytest.approx(0.86)  # 0.72, (none), 1.0
    assert shares["llamacpp as-stored"] == pytest.approx(0.22)
    assert entry["ours_over_best_llamacpp"] == pytest.approx(22.0 / 19.0)
    result = {
        "llamacpp_modes": ["repacked", "as-stored"],
        "entries": [entry],
        "plan": {"prompt_len": 16, "output_len": 128},
        "rounds": 3,
        "threads": 2,
    }
    row = bench.table(result).splitlines()[2]
    assert (
        row
        == "| llama-3.2-1b | Q8_0 | 1.00 | 22.0 (80%) | 19.0 (86%) | 11.0 (22%) | 1.16x | 40.0 | 2.0 |"
    )


def test_the_read_probe_times_reads_of_the_size_asked() -> None:
    single_stream = load_script("bench_single_stream")  # the probe every stream bench takes
    probe = single_stream.measure_read_bandwidth(64, 2)
    assert probe.tensor_bytes == 64 << 20
    assert len(probe.seconds) == 2
    assert probe.bytes_per_second > 1e8  # any machine reads 64 MiB in well under a second
    assert single_stream.read_rate(16) > 1e8


def test_bad_options_are_refused(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--llamacpp-modes", "fastest"])
