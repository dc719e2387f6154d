from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from asyncengine.bench import optimal_hit
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from asyncengine.scheduler.policy_guard import IDLE_POLL_SECONDS, PolicyStalledError
from asyncengine.sim import CostModel, Simulator, StepFeatures, VirtualClock, simulate
from asyncengine.workloads import Arrivals, WorkloadRequest, multi_turn, shared_prefix

ONE_SECOND_PER_STEP = CostModel(0.0 + 1.0, 0.0, 0.0, 0.0, 0.0, description="1 s per step")


def request(
    rid: str, arrival: float, prompt_len: int, output_len: int, first: int = 10
) -> WorkloadRequest:
    return WorkloadRequest(rid, arrival, list(range(first, first + prompt_len)), output_len)


def config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = {"page_size": 4, "kv_cache_tokens": 4096, "max_model_len": 512}
    base.update(overrides)
    pool = base["kv_cache_tokens"]
    if isinstance(pool, int) and "max_model_len" not in overrides:
        base["max_model_len"] = min(512, pool)  # a context set past the pool is refused
    return EngineConfig(**base)  # type: ignore[arg-type]


def test_virtual_clock() -> None:
    clock = VirtualClock()
    clock.advance(0.5)
    clock.advance_to(0.25)  # never backwards
    assert clock() == 0.5
    clock.advance_to(2.0)
    assert clock() == 2.0
    with pytest.raises(ValueError):
        clock.advance(-1.0)


def test_single_request_timeline_on_the_virtual_clock() -> None:
    result = simulate(config(), [request("a", 0.5, 10, 3)], ONE_SECOND_PER_STEP)
    record = result.records[0]
    # clock jumps to the arrival; prefill step ends at 1.5 with the first token, then 2 decodes
    assert record.token_times == [1.5, 2.5, 3.5]
    assert record.finish_time == 3.5
    assert result.steps == 3 and result.virtual_seconds == 3.5
    assert result.summary.ttft.p50 == 1.0
    assert result.summary.itl.p50 == 1.0 and result.summary.itl.count == 2
    assert result.summary.e2e.max == 3.0


def test_step_time_follows_the_cost_model() -> None:
    cost = CostModel(0.001, 0.01, 0.0, 0.002, 0.0001)
    result = simulate(config(chunked_prefill_size=0), [request("a", 0.0, 100, 2)], cost)
    prefill = 0.001 + 0.01 * 100
    decode = 0.001 + 0.002 + 0.0001 * 101  # one decode whose KV spans 101 tokens
    assert result.records[0].token_times == pytest.approx([prefill, prefill + decode])


def test_features_of_a_hand_made_plan() -> None:
    plan = BatchPlan(
        step=1,
        extends=[Segment("a", 0, [1, 2, 3], 0, True), Segment("b", 1, [4, 5], 10, False)],
        decodes=[Segment("c", 2, [7], 20, True), Segment("d", 3, [8], 5, True)],
    )
    features = StepFeatures.of_plan(plan)
    # a: queries see 1, 2, 3 keys; b: 11 and 12 keys
    assert features == StepFeatures(5, 6 + 23, 2, 21 + 6)
    cost = CostModel(1.0, 2.0, 3.0, 4.0, 5.0)
    expected = 1 + 2 * 5 + 3 * 29 + 4 * 2 + 5 * 27
    assert cost.step_time(plan) == pytest.approx(expected)
    simulator = Simulator(config(), cost)
    assert simulator.executor.seconds(plan) == pytest.approx(expected)


def test_fit_recovers_known_coefficients_and_drops_negative_ones() -> None:
    rng = np.random.default_rng(0)
    truth = CostModel(0.004, 3e-5, 2e-9, 1.5e-4, 0.0)
    rows = [
        StepFeatures(int(p), int(p * p / 2 + p * c), int(d), int(d * c))
        for p, c, d in zip(
            rng.integers(0, 2048, 60),
            rng.integers(0, 1024, 60),
            rng.integers(0, 64, 60),
            strict=True,
        )
    ]
    times = [truth.time_of(f) for f in rows]
    fitted = CostModel.fit(rows, times, description="synthetic")
    assert fitted.coefficients == pytest.approx(truth.coefficients, rel=1e-6, abs=1e-12)
    assert fitted.description == "synthetic"
    noisy = [t * (1 + 0.05 * e) for t, e in zip(times, rng.standard_normal(60), strict=True)]
    robust = CostModel.fit(rows, noisy)
    assert all(c >= 0 for c in robust.coefficients)
    assert float(np.median(robust.relative_errors(rows, times))) < 0.05
    with pytest.raises(ValueError):
        CostModel.fit(rows[:2], [1.0])


def test_cost_model_json_round_trip(tmp_path: Path) -> None:
    model = CostModel(0.1, 0.2, 0.3, 0.4, 0.5, description="x")
    model.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == model
    (tmp_path / "bad.json").write_text('{"intercept": 1, "typo": 2}')
    with pytest.raises(ValueError, match="typo"):
        CostModel.load(tmp_path / "bad.json")


def test_shipped_default_cost_model_is_fitted_and_sane() -> None:
    from asyncengine.sim.cost_model import DEFAULT_COST_MODEL_PATH

    model = CostModel.default()
    assert DEFAULT_COST_MODEL_PATH.exists() and model.description.startswith("fitted")
    assert all(c >= 0 for c in model.coefficients) and model.intercept > 0
    decode = [
        model.time_of(StepFeatures(decode_requests=b, decode_context=b * 512)) for b in (1, 8, 64)
    ]
    assert decode == sorted(decode)
    long_prefix = model.time_of(StepFeatures(512, 512 * 2048 + 512 * 513 // 2))
    assert long_prefix > model.time_of(StepFeatures(512, 512 * 513 // 2))
    # the built-in fallback is the shipped fit, rounded
    assert CostModel().coefficients == pytest.approx(model.coefficients, rel=0.05)


def test_sequential_shared_prefix_hits_the_cache() -> None:
    shared = list(range(100, 140))  # 40 tokens = 10 pages of 4
    workload = [
        WorkloadRequest("a", 0.0, [*shared, 1, 2], 2),
        WorkloadRequest("b", 100.0, [*shared, 3], 2),  # arrives after a finished
    ]
    result = simulate(config(), workload, ONE_SECOND_PER_STEP)
    assert [r.cached_tokens for r in result.records] == [0, 40]
    best = optimal_hit([w.prompt_ids for w in workload], page_size=4)
    assert result.summary.cache_hit_rate == pytest.approx(best.rate)


def test_concurrent_requests_share_steps_and_the_clock() -> None:
    workload = [request("a", 0.0, 8, 4, first=10), request("b", 0.0, 8, 4, first=50)]
    result = simulate(config(), workload, ONE_SECOND_PER_STEP)
    # both prefill in step 1 and decode together: 4 steps in all
    assert result.steps == 4 and result.virtual_seconds == 4.0
    assert all(r.token_times == [1.0, 2.0, 3.0, 4.0] for r in result.records)
    assert result.summary.request_throughput == pytest.approx(0.5)


def test_context_limit_like_the_engine() -> None:
    # a prompt that fills the context is refused; one near it generates up to the limit
    workload = [
        request("ok", 0.0, 8, 2),
        request("long", 0.0, 512, 2),
        request("near", 0.0, 500, 20),
    ]
    result = simulate(config(), workload, ONE_SECOND_PER_STEP)
    assert (result.summary.num_completed, result.summary.num_failed) == (2, 1)
    assert [r.output_tokens for r in result.records] == [2, 0, 12]


def test_kv_pool_size_follows_the_config() -> None:
    # the same builder as the engine: tokens round up to pages, bytes round down
    assert Simulator(config(kv_cache_tokens=4097)).core.kv.num_pages == 1025
    by_bytes = config(kv_cache_tokens=None, kv_cache_bytes=4 * 1000, max_model_len=400)
    assert Simulator(by_bytes, kv_bytes_per_token=10).core.kv.num_pages == 100
    assert Simulator(config()).core.kv.num_pages == 1024
    # the default model's K/V in kv_cache_bytes by the pool's dtype: int8 (or fp8) with its
    # scales holds ~1.94x the tokens of bfloat16
    pages = {
        kv: Simulator(
            config(kv_cache_tokens=None, kv_cache_bytes=64 << 20, kv_cache_dtype=kv)
        ).core.kv.num_pages
        for kv in ("auto", "bfloat16", "int8", "fp8")
    }
    assert pages["auto"] == pages["bfloat16"]
    assert 1.9 * pages["bfloat16"] <= pages["int8"] < 2 * pages["bfloat16"]
    assert pages["fp8"] == pages["int8"]


@pytest.mark.parametrize(
    "policy", ["fcfs", "lpm", "dfs-weight", "lpm+token-budget", "dynamic-chunking"]
)
@pytest.mark.usefixtures("quiet_scheduler")
def test_policies_finish_everything_under_memory_pressure(policy: str) -> None:
    workload = multi_turn(
        num_conversations=6, num_turns=3, vocab_size=500, system_len=32, output_len=24
    )
    small_kv = config(policy=policy, kv_cache_tokens=768, chunked_prefill_size=64)
    result = Simulator(small_kv, check_invariant_every=1).run(workload)
    summary = result.summary
    assert summary.num_completed == len(workload) and summary.num_failed == 0
    assert all(
        r.output_tokens == w.output_len for r, w in zip(result.records, workload, strict=True)
    )
    assert all(
        r.finish_time is not None and r.finish_time >= r.arrival_time for r in result.records
    )
    assert 0 <= summary.cache_hit_rate <= optimal_hit([w.prompt_ids for w in workload], 4).rate


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.usefixtures("quiet_scheduler")
def test_the_engine_counts_each_prompt_once_under_memory_pressure(policy: str) -> None:
    """The engine's hit and miss tokens (/metrics, engine.stats()) agree with the records':
    a request retracted and admitted again, or whose admission failed on KV memory and was
    tried again, is counted once."""
    workload = shared_prefix(
        num_groups=4, questions_per_group=12, vocab_size=1000, prefix_len=64, seed=2
    )
    result = Simulator(config(policy=policy, kv_cache_tokens=256), check_invariant_every=1).run(
        workload
    )
    summary, stats = result.summary, result.core_stats
    assert summary.num_completed == len(workload) and stats["retractions"] > 0
    assert stats["hit_tokens"] == summary.cached_tokens
    assert stats["hit_tokens"] + stats["miss_tokens"] == summary.prompt_tokens
    assert stats["cache_hit_rate"] == pytest.approx(summary.cache_hit_rate)


def test_simulation_is_deterministic_and_prefix_aware_policies_help() -> None:
    workload = shared_prefix(
        num_groups=4, questions_per_group=12, vocab_size=1000, prefix_len=64, seed=2
    )
    small = config(kv_cache_tokens=1024, max_running_requests=8)
    first = simulate(small.replace(policy="fcfs"), workload)
    again = simulate(small.replace(policy="fcfs"), workload)
    assert [r.token_times for r in first.records] == [r.token_times for r in again.records]
    lpm = simulate(small.replace(policy="lpm"), workload)
    best = optimal_hit([w.prompt_ids for w in workload], 4).rate
    assert lpm.summary.cache_hit_rate <= best + 1e-12
    assert lpm.summary.cache_hit_rate >= first.summary.cache_hit_rate
    assert not math.isnan(lpm.summary.ttft.p99)


def test_a_simulator_runs_once() -> None:
    simulator = Simulator(config(), ONE_SECOND_PER_STEP)
    simulator.run([request("a", 0.0, 4, 1)])
    with pytest.raises(RuntimeError):
        simulator.run([request("b", 0.0, 4, 1)])


def scaled_world(
    workload: list[WorkloadRequest], cost: CostModel, factor: float
) -> tuple[list[WorkloadRequest], CostModel]:
    """The same workload on a machine ``factor`` times slower, arriving ``factor`` times slower."""
    slow = CostModel(*(c * factor for c in cost.coefficients), description="scaled")
    arrivals = [
        WorkloadRequest(w.rid, w.arrival_time * factor, w.prompt_ids, w.output_len)
        for w in workload
    ]
    return arrivals, slow


@pytest.mark.usefixtures("quiet_scheduler")
def test_lpm_schedules_the_same_on_a_slower_machine() -> None:
    """LPM's aging and starvation cap are in work (prefilled tokens), not seconds: on a machine
    8x slower with arrivals 8x further apart, every decision is the same and every time is 8x.
    (A power of two keeps the scaled floating-point times exact.)"""
    workload = shared_prefix(
        num_groups=4,
        questions_per_group=10,
        vocab_size=1000,
        prefix_len=128,
        arrivals=Arrivals("poisson", rate=20.0),
        seed=3,
    )
    small = config(
        policy="lpm",
        kv_cache_tokens=640,
        policy_options={"aging": 0.02, "max_wait_tokens": 4000},
    )
    cost = CostModel.default()
    fast = simulate(small, workload, cost)
    slow_workload, slow_cost = scaled_world(workload, cost, 8.0)
    slow = simulate(small, slow_workload, slow_cost)
    assert slow.steps == fast.steps
    assert [r.cached_tokens for r in slow.records] == [r.cached_tokens for r in fast.records]
    assert [[t / 8 for t in r.token_times] for r in slow.records] == [
        r.token_times for r in fast.records
    ]


class HoldUntilFive(Policy):
    """A batching window: admits nothing before t = 5 s."""

    orders = True

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return waiting if ctx.now >= 5.0 else []


class HoldUntilFiveSaysSo(HoldUntilFive):
    def wake_time(self, ctx: PolicyContext) -> float | None:
        return 5.0


class ZeroBudget(Policy):
    budgets = True

    def budget(self, ctx: PolicyContext) -> StepBudget:
        return StepBudget(0, 0, 0)


HERE = "tests.sim.test_simulator"


def test_a_policy_that_holds_runs_to_completion_at_its_wake_time() -> None:
    # one request and nothing else to arrive: the clock has no event to go to but the policy's
    result = simulate(config(policy=f"{HERE}:HoldUntilFiveSaysSo"), [request("a", 0.0, 10, 3)],
                      ONE_SECOND_PER_STEP)  # fmt: skip
    assert result.records[0].token_times == [6.0, 7.0, 8.0]  # admitted at 5, 1 s a step
    assert result.scheduler_stats["policy_idle_holds"] == 1  # one jump, no polling
    assert result.scheduler_stats["policy_idle_seconds"] == 5.0


def test_a_policy_that_holds_without_a_wake_time_is_polled_like_the_engine() -> None:
    # a later arrival is no reason to sleep past t = 5: the engine asks again every poll
    workload = [request("a", 0.0, 10, 3), request("b", 100.0, 10, 1, first=50)]
    result = simulate(config(policy=f"{HERE}:HoldUntilFive"), workload, ONE_SECOND_PER_STEP)
    first = result.records[0].token_times[0]
    assert 6.0 <= first <= 6.0 + IDLE_POLL_SECONDS + 1e-9
    assert result.records[1].token_times == [101.0]
    stats = result.scheduler_stats
    assert stats["policy_idle_holds"] >= 5.0 / IDLE_POLL_SECONDS
    assert 5.0 <= stats["policy_idle_seconds"] <= 5.0 + IDLE_POLL_SECONDS + 1e-9
    assert stats["policy_failures"] == 0


@pytest.mark.parametrize("bound", [2.0, 0.0])
def test_a_policy_that_never_admits_is_an_error_naming_it_and_the_requests(bound: float) -> None:
    workload = [request("a", 0.0, 10, 3), request("b", 0.5, 10, 3, first=50)]
    with pytest.raises(PolicyStalledError) as raised:
        simulate(config(policy=f"{HERE}:ZeroBudget", max_policy_stall=bound), workload,
                 ONE_SECOND_PER_STEP)  # fmt: skip
    message = str(raised.value)
    assert "policy 'ZeroBudget' admitted nothing" in message
    assert "2 request(s) wait ('a', 'b')" in message


def test_a_waiting_request_times_out_while_the_policy_holds() -> None:
    workload = [replace(request("a", 0.0, 10, 3), timeout=1.0)]
    result = simulate(config(policy=f"{HERE}:ZeroBudget"), workload, ONE_SECOND_PER_STEP)
    record = result.records[0]
    assert record.timed_out and record.finish_time == 1.0  # at its deadline, not a poll later
