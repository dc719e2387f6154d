"""The simulator's multi-replica mode: N simulated engines behind the real router classes."""

from __future__ import annotations

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.routing import CacheAwareRouter, make_router
from asyncengine.scheduler.policy_guard import PolicyStalledError
from asyncengine.sim.multi_replica import MultiReplicaSimulator
from asyncengine.sim.simulator import simulate
from asyncengine.workloads import Arrivals, WorkloadRequest, make_workload

CONFIG = EngineConfig(
    page_size=16, kv_cache_tokens=4096, max_model_len=2048, chunked_prefill_size=256
)


def grouped(seed: int = 0, rate: str = "poisson:40") -> list:
    return make_workload(
        "shared_prefix",
        num_groups=12,
        questions_per_group=6,
        prefix_len=256,
        vocab_size=1000,
        output_len=16,
        arrivals=Arrivals.parse(rate),
        seed=seed,
    )


def hit_tokens(records: list) -> int:
    return sum(r.cached_tokens for r in records)


@pytest.mark.parametrize("router", ["cache-aware", "round-robin", "least-loaded"])
def test_one_replica_behind_any_router_is_the_single_simulator(router: str) -> None:
    workload = grouped()
    single = simulate(CONFIG, workload)
    multi = MultiReplicaSimulator(CONFIG, 1, make_router(router)).run(workload)
    assert [r.token_times for r in multi.records] == [r.token_times for r in single.records]
    assert [r.cached_tokens for r in multi.records] == [r.cached_tokens for r in single.records]
    assert multi.steps == single.steps
    assert {d.replica for d in multi.decisions} == {0}


def test_cache_aware_keeps_the_hits_a_round_robin_loses() -> None:
    workload = grouped()
    single = hit_tokens(simulate(CONFIG, workload).records)
    runs = {
        name: MultiReplicaSimulator(CONFIG, 2, make_router(name)).run(workload)
        for name in ("cache-aware", "round-robin")
    }
    aware, rr = (hit_tokens(runs[n].records) for n in ("cache-aware", "round-robin"))
    assert aware >= 0.9 * single
    assert rr < 0.9 * aware
    for run in runs.values():
        assert run.summary.num_completed == len(workload)
        assert {d.replica for d in run.decisions} == {0, 1}
    # a group's later requests follow its first one
    first: dict[str, int] = {}
    by_rid = {w.rid: w for w in workload}
    moved = 0
    for d in runs["cache-aware"].decisions:
        prefix = tuple(by_rid[d.rid].prompt_ids[:256])
        group = str(hash(prefix))
        moved += group in first and first[group] != d.replica
        first.setdefault(group, d.replica)
    assert moved <= 6  # the tree forgets a prefix only when a replica's cache is full


def test_runs_are_deterministic() -> None:
    workload = grouped(seed=3)
    a = MultiReplicaSimulator(CONFIG, 3, make_router("cache-aware")).run(workload)
    b = MultiReplicaSimulator(CONFIG, 3, make_router("cache-aware")).run(workload)
    assert [(d.rid, d.replica, d.reason) for d in a.decisions] == [
        (d.rid, d.replica, d.reason) for d in b.decisions
    ]
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]


def test_the_load_guard_spreads_a_burst_of_one_prefix() -> None:
    workload = make_workload(
        "shared_prefix",
        num_groups=1,
        questions_per_group=40,
        prefix_len=256,
        vocab_size=1000,
        output_len=32,
        arrivals=Arrivals.parse("burst"),
    )
    router = CacheAwareRouter(balance_abs_threshold=4, balance_rel_threshold=1.5)
    run = MultiReplicaSimulator(CONFIG, 2, router).run(workload)
    reasons = {d.reason for d in run.decisions}
    assert "load_guard" in reasons and "prefix" in reasons
    per_replica = [sum(d.replica == i for d in run.decisions) for i in (0, 1)]
    assert min(per_replica) >= 10
    assert run.summary.num_completed == 40


@pytest.mark.parametrize("policy", ["HoldUntilFiveSaysSo", "HoldUntilFive", "ZeroBudget"])
def test_a_policy_that_holds_runs_behind_the_router_as_in_the_single_simulator(
    policy: str,
) -> None:
    """A replica whose policy holds tries again at its wake time (or the engine's next poll)
    rather than at the next arrival; one that never admits is named as stalled."""
    from tests.sim.test_simulator import ONE_SECOND_PER_STEP, config, request

    settings = config(policy=f"tests.sim.test_simulator:{policy}", max_policy_stall=20.0)
    workload = [request("a", 0.0, 10, 3), request("b", 100.0, 10, 1, first=50)]
    if policy == "ZeroBudget":
        for run in (
            lambda: simulate(settings, workload, ONE_SECOND_PER_STEP),
            lambda: MultiReplicaSimulator(
                settings, 1, make_router("round-robin"), ONE_SECOND_PER_STEP
            ).run(workload),
        ):
            with pytest.raises(PolicyStalledError, match="'ZeroBudget' admitted nothing"):
                run()
        return
    single = simulate(settings, workload, ONE_SECOND_PER_STEP)
    multi = MultiReplicaSimulator(settings, 1, make_router("round-robin"), ONE_SECOND_PER_STEP)
    result = multi.run(workload)
    assert [r.token_times for r in result.records] == [r.token_times for r in single.records]
    assert result.records[0].token_times[0] < 7.0  # admitted at 5, not at b's arrival (100)
    assert (
        result.replica_stats[0]["policy_idle_holds"] == single.scheduler_stats["policy_idle_holds"]
    )


def test_one_replica_replays_salts_and_choices_as_the_single_simulator() -> None:
    prompt = list(range(1, 65))
    workload = [
        WorkloadRequest("a", 0.0, prompt, 4, cache_salt="a"),
        WorkloadRequest("b", 5.0, prompt, 4, cache_salt="b"),
        WorkloadRequest("fan", 10.0, prompt, 4, cache_salt="c", n=3),
    ]
    single = simulate(CONFIG, workload).records
    multi = MultiReplicaSimulator(CONFIG, 1, make_router("round-robin")).run(workload).records
    cached = {r.rid: r.cached_tokens for r in single}
    # a new namespace each: only the later choices hit, on the pages choice 0 computed
    assert list(cached) == ["a", "b", "fan-0", "fan-1", "fan-2"]
    assert cached["a"] == cached["b"] == cached["fan-0"] == 0
    assert cached["fan-1"] >= 48 and cached["fan-2"] >= 48
    assert {r.rid: r.cached_tokens for r in multi} == cached
    assert all(r.output_tokens == 4 for r in multi)
