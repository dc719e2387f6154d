"""scripts/micro/bench_amx_ab.py: this tree's AMX product against another build, per projection
of a shape; here the other build is this tree's own library, so both sides must give the same
bits (the script checks it) and every projection and row count gets both times."""

from __future__ import annotations

import json
from pathlib import Path

from asyncengine.kernels.cpu import cpu_native
from tests.kernels.test_quant_amx import needs_amx
from tests.scripts.test_bench_scripts import load_script


@needs_amx
def test_every_projection_is_timed_on_both_builds(tmp_path: Path) -> None:
    bench = load_script("micro/bench_amx_ab")
    library = cpu_native.library_path("cpu_quant_amx")
    assert library.exists()  # built when available() loaded it
    out = tmp_path / "ab.json"
    bench.main(["--baseline-library", str(library), "--shape", "qwen2.5-1.5b", "--formats",
                "Q4_K", "--rows", "3,17", "--repeats", "1", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    cells = {(row["projection"], row["rows"]) for row in report["rows"]}
    names = ("qkv", "o_proj", "gate_up", "down", "lm_head")
    assert cells == {(name, rows) for name in names for rows in (3, 17)}
    assert all(row["ours_ms"] > 0 and row["baseline_ms"] > 0 for row in report["rows"])


@needs_amx
def test_amx_against_the_int8_product_times_every_projection() -> None:
    """bench_many_rows_step.py --amx-vs-dense ... --amx-against i8: the AMX product beside the
    int8 one (the crossover AMX_FROM_ROWS_BY_FORMAT comes from), per projection and row count."""
    bench = load_script("micro/bench_many_rows_step")
    report = bench.main(["--amx-vs-dense", "Q4_K", "--amx-against", "i8", "--shape",
                         "qwen2.5-1.5b", "--batches", "17", "--repeats", "1"])  # fmt: skip
    names = ("qkv", "o_proj", "gate_up", "down", "lm_head")
    assert [row["projection"] for row in report["rows"]] == list(names)
    assert all(row["amx_ms"] > 0 and row["i8_ms"] > 0 for row in report["rows"])
