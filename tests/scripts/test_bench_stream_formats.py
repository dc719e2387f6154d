"""scripts/bench_stream_formats.py's arithmetic (medians that skip failed llama-bench runs, the
bound, ours over llama.cpp's faster mode) and its table, on a made-up result; its refusals."""

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
        },
    }
    bench.summarize(entry, 25e9, ["repacked", "as-stored"])
    assert entry["bound_tokens_per_second"] == pytest.approx(25.0)
    assert entry["medians"]["asyncengine"] == 22.0
    assert entry["medians"]["llamacpp repacked"] == 19.0
    assert entry["ours_fraction_of_bound"] == pytest.approx(22.0 / 25.0)
    assert entry["ours_over_best_llamacpp"] == pytest.approx(22.0 / 19.0)
    result = {
        "llamacpp_modes": ["repacked", "as-stored"],
        "entries": [entry],
        "plan": {"prompt_len": 16, "output_len": 128},
        "rounds": 3,
        "bandwidth": {"gb_per_second": 25.0},
        "threads": 2,
    }
    row = bench.table(result).splitlines()[2]
    assert row == "| llama-3.2-1b | Q8_0 | 1.00 | 22.0 | 88% | 19.0 | 11.0 | 1.16x | 2.0 |"


def test_bad_options_are_refused(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--llamacpp-modes", "fastest"])
