"""The kv-events router: matches prompts against what replicas' KV events report (evictions
included), counts routed-but-unreported pages until their events arrive or expire, and in the
replica simulator is fed each replica's events as its steps land."""

from __future__ import annotations

from asyncengine.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, page_hashes
from asyncengine.common.config import EngineConfig
from asyncengine.routing import KVEventsRouter, ReplicaState, make_router
from asyncengine.sim.multi_replica import MultiReplicaSimulator
from asyncengine.workloads.trace import WorkloadRequest
from tests.cache.test_kv_events import tree_blocks

PS = 4
PROMPT = list(range(1, 30))  # 7 whole pages


def replicas(*loads: int) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", load) for i, load in enumerate(loads)]


def stored(tokens: list[int]) -> BlockStored:
    whole = len(tokens) - len(tokens) % PS
    return BlockStored(page_hashes(tokens, PS), None, tokens[:whole], PS, None, None)


def test_routes_to_the_replica_whose_events_hold_the_prefix_and_forgets_evictions() -> None:
    router = KVEventsRouter(page_size=PS, pending_seconds=0.0)
    router.observe("r1", [stored(PROMPT)])
    decision = router.route(PROMPT + [99], replicas(0, 0), now=1.0)
    assert (decision.replica_id, decision.reason, decision.matched_tokens) == ("r1", "prefix", 28)
    # r1 evicts the prompt's last five pages: two pages left, under the threshold; the prompt
    # goes back to r1 all the same (where it was routed: one home per prefix)
    router.observe("r1", [BlockRemoved(page_hashes(PROMPT, PS)[2:], None)])
    decision = router.route(PROMPT, replicas(0, 0), now=2.0)
    assert (decision.replica_id, decision.reason, decision.matched_tokens) == ("r1", "affinity", 8)
    # a prompt nobody holds nor was sent goes to the replica holding the fewest pages
    decision = router.route([50 + t for t in PROMPT], replicas(0, 0), now=3.0)
    assert (decision.replica_id, decision.reason) == ("r0", "least_cached")
    router.observe("r1", [AllBlocksCleared()])
    assert router.tree_stats()["tokens:r1"] == 0


def test_pages_routed_but_not_yet_reported_count_until_they_expire() -> None:
    router = KVEventsRouter(page_size=PS, pending_seconds=10.0)
    first = router.route(PROMPT, replicas(0, 0), now=0.0)
    second = router.route(PROMPT, replicas(0, 1 if first.replica_id == "r1" else 0), now=1.0)
    assert second.replica_id == first.replica_id and second.reason == "prefix"
    # after expiry the guess no longer counts as held; the prefix keeps its home
    third = router.route(PROMPT, replicas(0, 0), now=20.0)
    assert (third.replica_id, third.reason, third.matched_tokens) == (
        first.replica_id,
        "affinity",
        0,
    )


def test_the_load_guard_wins_over_the_prefix() -> None:
    router = KVEventsRouter(page_size=PS, balance_abs_threshold=4, balance_rel_threshold=1.5)
    router.observe("r0", [stored(PROMPT)])
    decision = router.route(PROMPT, replicas(40, 1), now=0.0)
    assert (decision.replica_id, decision.reason) == ("r1", "load_guard")


def test_the_simulator_feeds_it_every_replicas_events() -> None:
    config = EngineConfig(page_size=PS, kv_cache_tokens=512, log_interval=0)
    router = make_router("kv-events", page_size=PS)
    assert isinstance(router, KVEventsRouter)
    groups = [[g * 100 + t for t in range(1, 41)] for g in range(6)]
    workload = [
        WorkloadRequest(f"q{g}-{i}", 0.05 * (i * 6 + g), groups[g] + [7, i + 1, 9], 4)
        for i in range(8)
        for g in range(6)
    ]
    simulator = MultiReplicaSimulator(config, 2, router)
    result = simulator.run(workload)
    assert router.events_applied > 0
    for replica in simulator.replicas:  # the router's picture of each replica is its tree
        assert router.replicas[replica.replica_id].held == set(tree_blocks(replica.core.kv.tree))
    by_prefix: dict[str, set[int]] = {}
    for decision in result.decisions:
        by_prefix.setdefault(decision.rid.split("-")[0], set()).add(decision.replica)
    assert all(len(chosen) == 1 for chosen in by_prefix.values())  # each prefix kept its replica
    assert result.summary.cache_hit_rate > 0.5
