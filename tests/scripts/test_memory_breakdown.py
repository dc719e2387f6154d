"""scripts/memory_breakdown.py on the embedded model: every phase's table row and JSON, the
components within the resident set, the GGUF's pages gone once the model is built."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.native_support import needs_native
from tests.scripts.test_bench_scripts import load_script

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self"),
    needs_native,
]


def test_a_short_run_accounts_every_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "memory.json"
    argv = ["memory_breakdown.py", "--long-prompt", "40", "--concurrency", "2"]
    argv += ["--output-len", "3", "--prompt-len", "8", "--engine-arg", "kv_cache_tokens=1024"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    load_script("memory_breakdown").main()
    result = json.loads(out.read_text())
    phases = {row["phase"]: row for row in result["phases"]}
    assert list(phases) == [
        "interpreter", "imports", "started", "one stream", "40-token prompt", "2 concurrent",
    ]  # fmt: skip
    for name in ("started", "one stream", "40-token prompt", "2 concurrent"):
        row = phases[name]
        parts = row["components"]
        arena = parts["weights: arena (quantized, packed)"]
        assert 0 < arena["resident"] <= arena["allocated"]
        assert parts["weights: GGUF file map"]["resident"] < arena["resident"] / 10
        assert sum(p["resident"] for p in parts.values()) <= row["rss"] <= row["peak_rss"]
    assert phases["2 concurrent"]["components"]["KV pool"]["resident"] > 0
