"""The recompute-tax reproduction (vLLM #54644): every victim rule with recompute and the
default one with swap, on a short simulated run."""

from __future__ import annotations

from asyncengine.policies.victims import VICTIM_RULES
from asyncengine.sim.reproductions import REPRODUCTIONS
from asyncengine.sim.reproductions.recompute_tax import RecomputeTax


def test_recompute_tax_measures_every_victim_rule_and_swap() -> None:
    assert isinstance(REPRODUCTIONS["recompute-tax"], RecomputeTax)
    small = RecomputeTax()
    small.sim_setting = (
        dict(num_requests=120, input_median=180.0, output_median=120.0, max_input_len=1024,
             max_output_len=512, rate=0.6),
        4096,
    )  # fmt: skip
    outcome = small.run(real=False)
    numbers = outcome.numbers
    assert set(numbers) == {f"{rule}, recompute" for rule in VICTIM_RULES} | {"newest, swap"}
    for rule in VICTIM_RULES:
        run = numbers[f"{rule}, recompute"]
        assert run["retractions"] > 0 and run["recomputed_tokens"] > 0
        assert run["recompute_tax"] == run["recomputed_tokens"] / run["computed_tokens"]
        assert run["swapped_bytes"] == 0
    swap = numbers["newest, swap"]
    assert swap["recompute_tax"] == 0 and swap["swapped_bytes"] > 0 and swap["swap_seconds"] > 0
    # lowest-priority with equal priorities orders as newest does
    assert numbers["lowest-priority, recompute"] == numbers["newest, recompute"]
    assert "recompute tax" in outcome.table and "`least-computed`" in outcome.table
