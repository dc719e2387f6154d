"""scripts/micro/bench_i8_ab.py: this tree's int8 product against another build, per projection
of a shape; here the other build is this tree's own library, so both sides give the same bits.
With ``--cpu-time`` (one thread) every call is timed by the thread's CPU clock."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from asyncengine.kernels.cpu import cpu_native
from tests.kernels.test_quant_i8gemm import needs_fast
from tests.scripts.test_bench_scripts import load_script


@needs_fast
def test_cpu_time_times_every_call_by_the_threads_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_script("micro/bench_i8_ab")
    assert cpu_native.load("cpu_quant_i8gemm") is not None
    library = cpu_native.library_path("cpu_quant_i8gemm")
    reads = []
    thread_time = time.thread_time

    def counted() -> float:
        reads.append(1)
        return thread_time()

    monkeypatch.setattr(time, "thread_time", counted)
    out = tmp_path / "ab.json"
    bench.main(["--baseline-library", str(library), "--shape", "smollm2-135m", "--formats",
                "Q4_1,Q8_0", "--rows", "3,40", "--only", "q_proj,down", "--repeats", "2",
                "--threads", "1", "--cpu-time", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    cells = {(row["format"], row["projection"], row["rows"]) for row in report["rows"]}
    assert cells == {
        (f, p, n) for f in ("Q4_1", "Q8_0") for p in ("q_proj", "down") for n in (3, 40)
    }
    assert all(row["ours_ms"] > 0 and row["baseline_ms"] > 0 for row in report["rows"])
    assert all(row["max_rel_diff"] == 0 for row in report["rows"])
    # 8 cells x 2 builds: two reads for each of the 2 timed calls, one for the warm-up call
    assert len(reads) == 8 * 2 * (2 * 2 + 1)


def test_cpu_time_refuses_several_threads(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("micro/bench_i8_ab")
    with pytest.raises(SystemExit):
        bench.main(["--baseline-library", "unused.so", "--threads", "2", "--cpu-time"])
    assert "--cpu-time needs --threads 1" in capsys.readouterr().err
