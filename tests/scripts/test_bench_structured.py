"""Smoke run of scripts/bench_structured.py on the tiny model: every mode generates, and the
fork computes fewer prompt tokens than n separate requests."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tests.scripts.test_bench_scripts import load_script
from tests.server_support import tiny_model_dir


def test_bench_structured_runs_on_a_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    script = load_script("bench_structured")
    args = argparse.Namespace(
        model=str(tiny_model_dir(tmp_path_factory)),
        dtype="float32",
        requests=2,
        tokens=8,
        repeats=1,
        n=3,
        json=None,
    )
    result = asyncio.run(script.main(args))
    script.print_table(result)
    assert result["compile"]["cold_compile_s"] > result["compile"]["cached_lookup_s"] > 0
    assert set(result["decode_tokens_per_s"]) == {"none", "json_schema", "json_object"}
    assert all(rate > 0 for rate in result["decode_tokens_per_s"].values())
    fork, separate = result["prefill_tokens"].values()
    assert fork < separate
