"""The simulator's bulk decoding (sim/bulk_decode.py) gives exactly the step-by-step results.

Each case runs one trace twice, ``bulk_decode`` on and off, and compares every request's record
(token times, finish time, cached tokens, retractions, admission blocks), the step count, the
virtual time and every counter of the scheduler and the core.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pytest

from asyncengine.cache.manager import KVCacheManager, SeqKV
from asyncengine.cache.page_table import PageTable
from asyncengine.common.config import EngineConfig
from asyncengine.sim import CostModel, SimResult, Simulator
from asyncengine.workloads import (
    Arrivals,
    WorkloadRequest,
    make_workload,
    multi_tenant,
    multi_turn,
    priority_mix,
    shared_prefix,
)

POISSON_2 = Arrivals.parse("poisson:2")


def _run(
    config: EngineConfig, workload: list[WorkloadRequest], bulk: bool, **options: object
) -> tuple[SimResult, Simulator]:
    sim = Simulator(config, CostModel.default(), bulk_decode=bulk, **options)  # type: ignore[arg-type]
    return sim.run(workload), sim


def _same(config: EngineConfig, workload: list[WorkloadRequest], **options: object) -> int:
    """Assert both paths agree; the number of steps run in bulk."""
    slow, _ = _run(config, workload, False, **options)
    fast, sim = _run(config, workload, True, **options)
    assert [asdict(r) for r in fast.records] == [asdict(r) for r in slow.records]
    assert fast.steps == slow.steps
    assert fast.virtual_seconds == slow.virtual_seconds
    assert fast.peak_waiting == slow.peak_waiting
    assert fast.scheduler_stats == slow.scheduler_stats
    # as JSON: a NaN (Kendall tau with nothing scored) equals itself there
    assert json.dumps(fast.core_stats, sort_keys=True) == json.dumps(
        slow.core_stats, sort_keys=True
    )
    assert fast.summary == slow.summary
    assert sim.bulk is not None
    return sim.bulk.bulk_steps


def _workload(name: str, n: int, rate: float, seed: int = 0) -> list[WorkloadRequest]:
    return make_workload(
        name, num_requests=n, arrivals=Arrivals.parse(f"poisson:{rate}"), seed=seed
    )


pytestmark = pytest.mark.usefixtures("quiet_scheduler")


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "sjf", "dfs-weight"])
def test_overloaded_random_mix(policy: str) -> None:
    workload = _workload("random", 300, 3.0)
    bulk_steps = _same(EngineConfig(policy=policy, kv_cache_tokens=8192), workload)
    assert bulk_steps > 0


def test_kv_shortage_retracts_and_recomputes_the_same() -> None:
    workload = _workload("random", 200, 4.0, seed=3)
    config = EngineConfig(kv_cache_tokens=2048, init_new_token_ratio=0.1, min_new_token_ratio=0.05)
    slow, _ = _run(config, workload, False)
    assert slow.scheduler_stats["retractions"] > 0  # the case is what it says
    assert _same(config, workload) > 0


@pytest.mark.parametrize("victim", ["newest", "least-computed", "largest-kv"])
def test_swap_preemption(victim: str) -> None:
    workload = _workload("random", 150, 4.0, seed=5)
    config = EngineConfig(
        kv_cache_tokens=2048,
        init_new_token_ratio=0.1,
        min_new_token_ratio=0.05,
        preemption_mode="swap",
        preemption_victim=victim,
        swap_space_bytes=64 << 20,
    )
    assert _same(config, workload) > 0


def test_chunked_prefill_and_prefix_cache() -> None:
    workload = shared_prefix(
        num_groups=6, questions_per_group=30, prefix_len=256, arrivals=POISSON_2, seed=1
    )
    config = EngineConfig(policy="lpm", chunked_prefill_size=64, kv_cache_tokens=6144)
    assert _same(config, workload) > 0


def test_multi_turn_prefix_cache_lpm() -> None:
    workload = multi_turn(num_conversations=40, num_turns=4, arrivals=POISSON_2, seed=2)
    assert _same(EngineConfig(policy="lpm", kv_cache_tokens=4096), workload) > 0


def test_timeouts_and_context_limit() -> None:
    workload = _workload("random", 200, 3.0, seed=4)
    workload = [
        replace(item, timeout=20.0 + (i % 7) * 5.0) if i % 3 == 0 else item
        for i, item in enumerate(workload)
    ]
    config = EngineConfig(kv_cache_tokens=8192, max_model_len=600, max_queue_time=60.0)
    slow, _ = _run(config, workload, False)
    assert slow.core_stats["finished_timeout"] > 0
    assert _same(config, workload) > 0


def test_token_budget_and_invariant_checks() -> None:
    workload = _workload("random", 150, 2.0, seed=6)
    config = EngineConfig(policy="token-budget", kv_cache_tokens=4096)
    assert _same(config, workload, check_invariant_every=7) > 0


def test_policies_that_see_decodes_run_step_by_step() -> None:
    workload = multi_tenant(num_heavy=100, num_light=20)
    assert _same(EngineConfig(policy="fair"), workload) == 0
    config = EngineConfig(policy="priority", policy_options={"preempt": True})
    assert _same(config, priority_mix(num_requests=120, rate=3.0)) == 0


def test_a_step_hook_turns_bulk_off() -> None:
    workload = _workload("random", 80, 3.0)
    sim = Simulator(EngineConfig(), CostModel.default())
    seen: list[int] = []
    sim.core.step_hooks.append(lambda plan: seen.append(len(plan.decodes)))
    result = sim.run(workload)
    assert sim.bulk is not None and sim.bulk.bulk_steps == 0
    assert len(seen) == result.steps


def _pool_with_history(cached: int) -> tuple[KVCacheManager, list[SeqKV]]:
    """A 26-page pool of 4-token pages: ``cached`` finished prompts in the tree (2 evictable
    pages each), then five open sequences (7 pages) whose pages are full."""
    kv = KVCacheManager(num_pages=26, page_size=4, max_rows=16, max_pages_per_row=16)
    for i in range(cached):
        seq = kv.open([1000 * (i + 1) + t for t in range(9)])
        kv.extend(seq, 9)
        kv.close(seq, [1000 * (i + 1) + t for t in range(9)])
    seqs = []
    for i in range(5):
        seq = kv.open([50 + i, 60 + i, 70 + i, 80 + i, 90 + i])
        kv.extend(seq, 4 * (i % 2 + 1))
        seqs.append(seq)
    return kv, seqs


@pytest.mark.parametrize("cached", range(11))  # free pages, kept tails, tree pages
def test_extend_each_by_one_is_extend_one_by_one(cached: int) -> None:
    one_by_one, seqs_a = _pool_with_history(cached)
    together, seqs_b = _pool_with_history(cached)
    for seq in seqs_a:
        one_by_one.extend(seq, 1)
    together.extend_each_by_one(seqs_b)
    assert [s.pages for s in seqs_a] == [s.pages for s in seqs_b]
    assert [s.kv_len for s in seqs_a] == [s.kv_len for s in seqs_b]
    assert one_by_one.allocator.free_pages().tolist() == together.allocator.free_pages().tolist()
    assert one_by_one.page_table.drain_writes() == together.page_table.drain_writes()
    assert np.array_equal(one_by_one.page_table.array, together.page_table.array)
    assert one_by_one.tree.evictable_size == together.tree.evictable_size
    together.check_invariant()
    if cached == 8:  # 3 pages were free: the tree gave the other 2 to both the same way
        assert one_by_one.tree.evictable_size == 7 * 8


def test_page_table_set_each_is_set_page_in_order() -> None:
    rows, indexes, pages = [3, 0, 3, 5], [0, 2, 1, 3], [11, 7, 12, 9]
    one, each = PageTable(8, 4, record_writes=True), PageTable(8, 4, record_writes=True)
    for row, index, page in zip(rows, indexes, pages, strict=True):
        one.set_page(row, index, page)
    each.set_each(rows, indexes, pages)
    assert np.array_equal(one.array, each.array)
    assert one.drain_writes() == each.drain_writes()
    with pytest.raises(ValueError, match="row width"):
        each.set_each([1], [4], [2])


@pytest.mark.parametrize(
    ("config", "rate", "reasons"),
    [
        # the reservation leaves no page (no window taken), or the queue's head does not fit
        (EngineConfig(kv_cache_tokens=8192), 3.0, {"kv_reservation", "kv_reservation+window"}),
        (EngineConfig(max_running_requests=6, kv_cache_tokens=65536), 3.0, {"running_cap"}),
        (EngineConfig(kv_cache_tokens=65536), 0.3, {"decode_turn"}),
    ],
)
def test_quiet_steps_tell_admission_as_the_scheduler_does(
    config: EngineConfig, rate: float, reasons: set[str]
) -> None:
    """Steps that are nothing but counted decodes skip the scheduler's admission where its
    outcome is certain (sim/closed_admission.py): each such outcome, and the same results."""
    workload = _workload("random", 150, rate, seed=7)
    _same(config, workload)
    sim = Simulator(config, CostModel.default())
    sim.run(workload)
    assert sim.bulk is not None
    assert reasons <= set(sim.bulk.quiet_steps), sim.bulk.quiet_steps


def test_a_head_that_may_be_skipped_is_left_to_the_scheduler() -> None:
    """With ``kv_blocked_skips`` a request behind a blocked head may go first: no quiet step
    tells that admission; the results are still the step-by-step ones."""
    workload = _workload("random", 150, 3.0, seed=8)
    config = EngineConfig(kv_cache_tokens=8192, kv_blocked_skips=4)
    _same(config, workload)
    sim = Simulator(config, CostModel.default())
    sim.run(workload)
    assert sim.bulk is not None
    assert "kv_reservation+window" not in sim.bulk.quiet_steps


def test_quiet_steps_past_the_token_budget() -> None:
    """Short prompts fill the running batch past a 16-token step budget: the steps whose
    decodes alone spend it admit nothing, told without running admission."""
    workload = [
        WorkloadRequest(f"r{i}", i * 0.02, [5 + i % 7] * (6 + i % 5), 40 + i % 30)
        for i in range(150)
    ]
    config = EngineConfig(policy="token-budget", policy_options={"total_tokens": 16})
    _same(config, workload)
    sim = Simulator(config, CostModel.default())
    sim.run(workload)
    assert sim.bulk is not None
    assert sim.bulk.quiet_steps.get("token_budget", 0) > 0, sim.bulk.quiet_steps
