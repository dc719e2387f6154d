"""scripts/profile_step.py: an engine run and its replay split by part, the model's products timed
without changing which paths the model takes."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from asyncengine.executor.layers.linear import make_linear
from tests.scripts.test_bench_scripts import load_script


@pytest.fixture(scope="module")
def profile() -> ModuleType:
    return load_script("profile_step")


def test_a_call_inside_a_timed_call_of_its_part_counts_once(profile: ModuleType) -> None:
    timer = profile.Timer()
    inner = timer.wrap("part", lambda x: x + 1)
    outer = timer.wrap("part", lambda x: inner(x) * 2)
    assert outer(1) == 4
    assert timer.calls["part"] == 1 and timer.seconds["part"] > 0


def test_timed_products_keep_their_class_and_results(profile: ModuleType) -> None:
    weight = torch.randn(24, 32, generator=torch.Generator().manual_seed(0))
    linear = make_linear([weight], None, torch.float32)
    cls = type(linear)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    want = linear(x)
    timer = profile.Timer()
    profile.time_products(linear, timer, "GEMMs")
    assert isinstance(linear, cls)  # the model's isinstance checks pick the same paths
    assert torch.equal(linear(x), want)
    assert timer.calls["GEMMs"] == 1


def test_engine_run_and_replay_by_part(profile: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    result = profile.main(["--num-requests", "4", "--workload-arg", "input_median=24",
                           "--workload-arg", "output_median=8", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["steps"] == result["steps"] > 0
    parts = result["forward_parts_seconds"]
    assert parts["projections (GEMMs)"] > 0 and parts["LM head"] > 0
    # the replay's forward is all its parts: what none of them times is a small share
    assert parts["the rest (embedding, Python, dispatch)"] < 0.5 * sum(parts.values())
