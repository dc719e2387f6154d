"""scripts/bench_long_context.py's timing: the pools timed in turn, round by round, and each
test's speed over the first pool's."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.scripts.test_bench_scripts import load_script


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
        {"kv": "bfloat16-int8", "over": "bfloat16", "test": "decode", "context": 8000, "ratio": 1.5}
    ]
