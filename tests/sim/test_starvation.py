"""The starvation check: it passes policies that bound waits and fails those that do not,
user policies included (module:Class), and reports waits in prefill tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext
from asyncengine.sim.starvation import (
    CHECK_CONFIG,
    Adversary,
    adversarial_workload,
    check_starvation,
    judge,
    run_adversary,
)
from tests.scripts.test_compare_policies import load_script


class Newest(Policy):
    """Last come, first served: every later request overtakes the waiting ones."""

    name = "newest"
    orders = True

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return sorted(waiting, key=lambda r: -r.arrival_time)


SMALL = Adversary(stream=300, gap_ms=20.0, stream_prompt=48, victim_prompt=300, victim_output=8)


def config(policy: str, **options: object) -> EngineConfig:
    return EngineConfig.from_dict({**CHECK_CONFIG, "policy": policy, "policy_options": options})


def test_the_adversary_disfavours_its_victims() -> None:
    items = adversarial_workload(SMALL)
    stream = [w for w in items if w.rid.startswith("stream")]
    (victim,) = [w for w in items if w.rid.startswith("victim")]
    assert len(stream) == 300 and all(w.priority < victim.priority for w in stream)
    assert all(
        w.prompt_ids[: SMALL.hot_prefix] == stream[0].prompt_ids[: SMALL.hot_prefix] for w in stream
    )
    assert len(victim.prompt_ids) == 300 and victim.tenant == "victim"
    assert len({w.tenant for w in stream}) == SMALL.stream_tenants


def test_fcfs_overtakes_nobody_and_waits_are_counted_in_prefill_tokens() -> None:
    outcome = run_adversary(config("fcfs"), SMALL)
    assert outcome.problem is None and outcome.worst_overtaken_tokens == 0
    assert outcome.worst_wait_tokens > 0  # the stream outruns the engine: a queue builds


def test_a_policy_that_never_admits_is_reported_stuck() -> None:
    outcome = run_adversary(config("tests.sim.test_simulator:ZeroBudget"), SMALL)
    assert outcome.problem is not None and outcome.problem.startswith("stuck: ")
    assert "policy 'ZeroBudget' admitted nothing" in outcome.problem


@pytest.mark.parametrize(
    ("policy", "options", "starves"),
    [
        ("priority", {}, True),  # strict priority: the stream of better ones never ends
        ("priority", {"max_wait_tokens": 3000}, False),
        ("tests.sim.test_starvation:Newest", {}, True),
        ("sjf", {}, False),
    ],
)
def test_overtaking_that_grows_with_the_stream_is_starvation(
    policy: str, options: dict[str, object], starves: bool
) -> None:
    outcome, problem = judge(config(policy, **options), SMALL, 1.8, None)
    assert (problem is not None) == starves, problem
    if starves:
        assert "starved" in problem  # type: ignore[operator]
    else:  # bounded: overtaken by about the bound, not by the stream
        assert outcome.worst_overtaken_tokens < 3 * 6000


@pytest.mark.slow
def test_check_policy_script_passes_and_fails_with_a_shrunk_adversary(tmp_path: Path) -> None:
    script = load_script("check_policy")
    report = script.main(["tests.sim.test_starvation:Newest", "--examples", "2", "-q",
                          "--json", str(tmp_path / "r.json")])  # fmt: skip
    assert not report.passed and report.failing_adversary is not None
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["passed"] is False and "starved" in saved["failure"]
    assert saved["worst_overtaken_tokens"] >= report.worst_overtaken_tokens > 0
    passed = check_starvation("priority", {"max_wait_tokens": 3000}, examples=2)
    assert passed.passed and passed.examples == 3  # the default adversary and two drawn
    assert 0 < passed.worst_overtaken_tokens < passed.worst_wait_tokens


def test_adversaries_are_drawn_the_same_for_the_same_seed_in_their_ranges() -> None:
    import numpy as np

    from asyncengine.sim.starvation import KNOBS, draw_adversary

    first = [draw_adversary(np.random.default_rng(7)) for _ in range(1)]
    rng_a, rng_b = np.random.default_rng(7), np.random.default_rng(7)
    drawn = [draw_adversary(rng_a) for _ in range(50)]
    assert drawn == [draw_adversary(rng_b) for _ in range(50)]
    assert drawn[0] == first[0]
    assert drawn != [draw_adversary(np.random.default_rng(8)) for _ in range(50)]
    for name, knob in KNOBS.items():
        values = [getattr(adv, name) for adv in drawn]
        if len(knob) == 1:
            assert set(values) <= set(knob[0]) and len(set(values)) > 1, name
        else:
            assert all(knob[0] <= v <= knob[1] for v in values), name
