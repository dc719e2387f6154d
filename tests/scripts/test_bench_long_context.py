"""scripts/bench_long_context.py's timing: the pools timed in turn, round by round, and each
test's speed over the first pool's; it runs the model ``--model`` names, and a context past that
model's is one error line before anything loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from gguf import GGMLQuantizationType

from tests.executor.test_gguf_shapes import make_hf, write_gguf
from tests.scripts.test_bench_scripts import load_script
from tests.scripts.test_script_errors import ROOT, assert_one_error_line


@pytest.fixture(scope="module")
def long_context() -> ModuleType:
    return load_script("bench_long_context")


def test_pools_are_timed_in_turn_with_the_order_rotated(long_context: ModuleType) -> None:
    calls: list[str] = []
    runs = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    seconds = long_context.interleaved_seconds(4, runs)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert set(seconds) == {"a", "b", "c"} and all(s >= 0 for s in seconds.values())


def test_ratios_are_over_the_first_pool_per_test_and_context(long_context: ModuleType) -> None:
    row = long_context.Row
    rows = [
        row("asyncengine", "bfloat16", "decode", 8000, 64, 1, 80.0),
        row("asyncengine", "bfloat16-int8", "decode", 8000, 64, 1, 120.0),
        row("asyncengine", "bfloat16-int8", "prefill", 0, 8000, 1, 900.0),  # no base: left out
        row("llama.cpp", "f16", "decode", 8000, 64, 1, 40.0),
    ]
    got = long_context.ratios(rows, ["bfloat16", "bfloat16-int8"])
    assert got == [
        {
            "kv": "bfloat16-int8",
            "over": "bfloat16",
            "test": "decode",
            "context": 8000,
            "tokens": 64,
            "ratio": 1.5,
        }
    ]


def test_each_contexts_prefill_is_over_its_own_base(long_context: ModuleType) -> None:
    """Every context's first prefill is at depth 0: the prompt's length tells them apart."""
    row = long_context.Row
    rows = [
        row("asyncengine", "float32", "prefill", 0, 1024, 1, 400.0),
        row("asyncengine", "int8", "prefill", 0, 1024, 1, 200.0),
        row("asyncengine", "float32", "prefill", 0, 4096, 1, 100.0),
        row("asyncengine", "int8", "prefill", 0, 4096, 1, 150.0),
    ]
    got = {(r["tokens"], r["ratio"]) for r in long_context.ratios(rows, ["float32", "int8"])}
    assert got == {(1024, 0.5), (4096, 1.5)}


def test_it_runs_the_model_it_is_given(tmp_path: Path) -> None:
    """A small Q8_0 GGUF of a Llama 3 shape end to end: both contexts, the depth test only where
    twice the context fits the model's 512 positions, a batch shorter than the warm-up."""
    name = "llama3_rope_gqa8_untied"
    gguf_path = tmp_path / "model-q8_0.gguf"
    write_gguf(name, make_hf(name, tmp_path / "hf"), gguf_path, GGMLQuantizationType.Q8_0)
    out = tmp_path / "long.json"
    args = ["--model", str(gguf_path), "--contexts", "64,300", "--decode", "4", "--batch", "2"]
    args += ["--batch-context", "32", "--batch-decode", "2", "--kv", "float32,int8"]
    args += ["--llamacpp-kv", "", "--repeats", "1", "--bandwidth", "10", "--json", str(out)]
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_long_context.py"), *args],
        check=True,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )
    result = json.loads(out.read_text())
    assert result["setup"]["model"] == str(gguf_path)
    tests = {(r["kv"], r["test"], r["context"], r["tokens"]) for r in result["rows"]}
    for kv in ("float32", "int8"):
        assert {(kv, "prefill", 0, 64), (kv, "prefill", 64, 64), (kv, "prefill", 0, 300)} < tests
        assert {(kv, "decode", 64, 4), (kv, "decode", 300, 4), (kv, "batch decode", 32, 4)} < tests
        assert (kv, "prefill", 300, 300) not in tests
    assert len(result["ratios"]) == 6


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--contexts", "4096,8150"], "--contexts 8150 with --decode 64 reaches 8215 tokens, past"),
        (["--batch-context", "8190"], "--batch-context 8190 with --batch-decode 32 reaches 8223"),
        (["--kv", "int8,int4"], "--kv int4: each must be one of"),
        (["--model", "no-such-model"], "neither a .gguf file nor a known model name"),
        (["--contexts", "4k"], "a comma-separated list of token counts"),
    ],
)
def test_a_context_past_the_models_is_one_line(args: list[str], says: str) -> None:
    """The embedded model's context is 8,192 tokens: refused before any weights load."""
    assert_one_error_line("bench_long_context.py", args, says, dict(os.environ))
