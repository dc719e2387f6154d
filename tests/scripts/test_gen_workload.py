"""scripts/gen_workload.py writes every workload it lists, with its defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncengine.workloads import WORKLOADS
from asyncengine.workloads.trace import load_trace
from tests.scripts.test_compare_policies import load_script


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_listed_workload_is_written(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.jsonl"
    info = load_script("gen_workload").main([name, "--out", str(out), "--seed", "3"])
    requests = load_trace(out)
    assert info["requests"] == len(requests) > 0
    assert info["output_tokens"] == sum(r.output_len for r in requests)
