"""Smoke run of scripts/bench_speculative.py on the tiny model: every mode, both batch shapes,
a table and the JSON rows (speeds, acceptance) for each."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tests.scripts.test_bench_scripts import load_script
from tests.server_support import tiny_model_dir


def test_bench_speculative_writes_a_row_per_mode_and_batch(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    bench = load_script("bench_speculative")
    out = tmp_path / "spec.json"
    bench.main(
        [
            "--model", str(tiny_model_dir(tmp_path_factory)),
            "--workloads", "random",
            "--batches", "1", "3",
            "--prompts", "2",
            "--output-len", "6",
            "--kv-cache-tokens", "4096",
            "--out", str(out),
        ]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [
        (b, m) for b in (1, 3) for m in ("off", "fixed", "adaptive")
    ]
    assert all((r.get("decode_tok_s") or r.get("tok_s")) > 0 for r in rows)
    assert rows[0]["acceptance"] is None


def test_bench_speculative_runs_the_draft_modes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    bench = load_script("bench_speculative")
    model = str(tiny_model_dir(tmp_path_factory))
    out = tmp_path / "draft.json"
    bench.main(
        [
            "--model", model,
            "--draft-model", model,  # the target as its own draft: every guess accepted
            # where the verify's positions run as fused decode rows, with the draft's numerics:
            # a bfloat16 model's BF16 rows take 2 rows in the fused step (executor/layers/linear.py)
            "--draft-k", "1",
            "--modes", "off", "draft_fixed",
            "--workloads", "numbers",
            "--batches", "1",
            "--prompts", "1",
            "--output-len", "8",
            "--kv-cache-tokens", "4096",
            "--out", str(out),
        ]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["off", "draft_fixed"]
    assert rows[1]["acceptance"] > 0.9 and rows[1]["accepted_tokens"] > 0
    with pytest.raises(ValueError, match="--draft-model"):
        bench.main(["--modes", "off", "draft_adaptive"])


def test_bench_speculative_measures_llama_server_without_and_with_ngrams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--llamacpp starts the peer's server twice, the second time with its n-gram speculation;
    a stand-in server answers with llama-server's timings."""
    bench = load_script("bench_speculative")
    from peers.llamacpp import launcher

    started: list[tuple[str, ...]] = []

    class FakeServer:
        def __init__(self, model: Path, parallel: int, threads: int, extra_args: tuple[str, ...]):
            started.append(extra_args)

        def __enter__(self) -> FakeServer:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        async def complete(self, session: Any, prompt: list[int], n_predict: int) -> Any:
            rate = 40.0 if len(started) == 1 else 60.0
            return {"timings": {"predicted_per_second": rate, "draft_n": 4, "draft_n_accepted": 3}}

    monkeypatch.setattr(launcher, "LlamaServer", FakeServer)
    monkeypatch.setattr(launcher, "model_file", lambda kind: Path(f"{kind}.gguf"))
    args = argparse.Namespace(llamacpp_ngram_n=3, llamacpp_ngram_m=4, threads=1, output_len=8)
    result = bench.llamacpp_runs({"copy": [[5, 6, 7]]}, args)
    assert started[0] == () and "--spec-type" in started[1]
    assert result["llamacpp_off"]["copy"]["decode_tok_s"] == 40.0
    assert result["llamacpp_ngram"]["copy"] == {
        "decode_tok_s": 60.0,
        "per_request": [60.0],
        "acceptance": 0.75,
    }
