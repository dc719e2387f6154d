"""scripts/micro/bench_many_rows_step.py on a small Q8_0 GGUF: --vs-expanded runs both sides of
every decode batch and the prefill, the ratios are the tok/s quotients, the JSON is written; the
step's split runs with float32 activations (an AVX2 CPU's), which the modes that take bfloat16
refuse."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType

from tests.executor.test_gguf_shapes import make_hf, write_gguf

ROOT = Path(__file__).resolve().parents[2]


def small_gguf(tmp_path: Path) -> Path:
    name = "llama3_rope_gqa8_untied"
    gguf_path = tmp_path / "model-q8_0.gguf"
    write_gguf(name, make_hf(name, tmp_path / "hf"), gguf_path, GGMLQuantizationType.Q8_0)
    return gguf_path


def bench_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "bench_many_rows_step", ROOT / "scripts" / "micro" / "bench_many_rows_step.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_vs_expanded_times_both_sides_of_every_cell(tmp_path: Path) -> None:
    gguf_path = small_gguf(tmp_path)
    module = bench_module()
    out = tmp_path / "vs.json"
    result = module.main(
        [
            "--vs-expanded",
            "--model",
            str(gguf_path),
            "--batches",
            "1,3",
            "--prefill",
            "20",
            "--context",
            "8",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]  # fmt: skip
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    (model,) = result["models"]
    assert model["model"] == gguf_path.name
    assert model["kept"].startswith("Q8_0 x") and model["kept"].endswith("quantized")
    assert [c["cell"] for c in model["cells"]] == ["decode B=1", "decode B=3", "prefill 20"]
    assert [c["tokens"] for c in model["cells"]] == [1, 3, 20]
    for cell in model["cells"]:
        assert cell["quantized_tok_s"] > 0 and cell["expanded_tok_s"] > 0
        assert cell["ratio"] == cell["quantized_tok_s"] / cell["expanded_tok_s"]


def test_the_step_split_runs_with_float32_activations(tmp_path: Path) -> None:
    gguf_path = small_gguf(tmp_path)
    module = bench_module()
    args = ["--model", str(gguf_path), "--batches", "2", "--context", "8", "--repeats", "1"]
    result = module.main([*args, "--dtype", "float32"])
    assert result["dtype"] == "float32"
    (row,) = result["rows"]
    assert row["batch"] == 2 and row["quant"]["step"] > 0 and row["dense"]["step"] > 0
    with pytest.raises(SystemExit):
        module.main([*args, "--dtype", "float32", "--vs-expanded"])
