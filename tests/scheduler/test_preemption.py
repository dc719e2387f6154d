"""Preemption as a policy axis: the victim on KV shortage (config rule or the policy's choice)
and what happens to its KV (recompute, or swap to a host buffer and back), with the recompute
tax and swap traffic counted. The fake executor reads every token back from its KV slots, so a
page swapped back wrong changes the output."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine.cache.eviction_rule import EvictionRule
from asyncengine.cache.manager import SeqKV
from asyncengine.cache.radix_cache import RadixCache
from asyncengine.common.config import ConfigError
from asyncengine.common.request import Request, RequestStatus
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.engine_core import EngineCore
from asyncengine.policies.base import Policy, PolicyContext
from asyncengine.policies.victims import VICTIM_RULES, order_victims
from tests.fake_executor import FakeExecutor, fake_core, reference_output
from tests.scheduler.test_scheduler import Clock, drive, submit, workload

# 40 pages of 4 tokens for 24 requests of up to 64 outputs: decode must retract
SHORT_POOL = dict(
    num_pages=40,
    page_size=4,
    chunked_prefill_size=8,
    max_prefill_tokens=24,
    init_new_token_ratio=0.05,
    min_new_token_ratio=0.01,
)
# room for every request's KV swapped out at once (24 requests of at most 51 pages of 4 bytes)
# and no more: the KV invariant checks every host page after each step
SWAP_BYTES = 1 << 14


def short_core(**overrides: object) -> tuple[EngineCore, FakeExecutor, Clock]:
    clock = Clock()
    values = {**SHORT_POOL, **overrides}
    num_pages, page_size = values.pop("num_pages"), values.pop("page_size")
    model_len = values.pop("max_model_len", 4096)
    core, executor = fake_core(num_pages, page_size, model_len, clock, **values)  # type: ignore[arg-type]
    return core, executor, clock


def running_request(
    rid: str, prompt: int, outputs: int, priority: int = 0, in_tree: int = 0
) -> Request:
    req = Request(rid, list(range(prompt)), SamplingParams(priority=priority), 0.0)
    req.output_ids = [1] * outputs
    req.status = RequestStatus.RUNNING
    n = prompt + outputs
    req.seq = SeqKV(0, n, in_tree, list(range(-(-n // 4))), RadixCache(4).root, in_tree, n)
    return req


def test_each_victim_rule_orders_running_requests_as_documented() -> None:
    long_new = running_request("long-new", prompt=90, outputs=1)
    short_new = running_request("short-new", prompt=10, outputs=1)
    old = running_request("old", prompt=20, outputs=50)
    worse = running_request("worse", prompt=20, outputs=40, priority=5)
    shared = running_request("shared", prompt=100, outputs=30, in_tree=96)
    running = [old, short_new, worse, long_new, shared]

    def first(rule: str) -> list[str]:
        return [r.rid for r in order_victims(rule, running)]

    # fewest outputs first, then the longest prompt
    assert first("newest")[:2] == ["long-new", "short-new"]
    assert first("least-computed")[0] == "short-new"  # 11 tokens with KV
    assert first("lowest-priority")[0] == "worse"
    # 34 tokens outside the tree for "shared" (130 - 96); "long-new" holds 91 of its own
    assert first("largest-kv")[:2] == ["long-new", "old"]
    with pytest.raises(ValueError, match="unknown preemption victim rule"):
        order_victims("oldest", running)


def test_a_bad_victim_rule_or_an_empty_swap_space_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="preemption_victim"):
        short_core(preemption_victim="oldest")
    with pytest.raises(ConfigError, match="preemption_mode"):
        short_core(preemption_mode="drop")
    with pytest.raises(ConfigError, match="swap_space_bytes"):  # 1 byte per token, 4 per page
        short_core(preemption_mode="swap", swap_space_bytes=3)


@pytest.mark.parametrize("rule", sorted(VICTIM_RULES))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_exact_under_every_victim_rule_and_mode(rule: str, mode: str) -> None:
    core, runner, clock = short_core(
        preemption_victim=rule, preemption_mode=mode, swap_space_bytes=SWAP_BYTES
    )
    items = workload(seed=3, n=24, max_out=64)
    reqs = submit(core, clock, items)
    drive(core, runner, clock)  # the KV invariant (host buffer included) after every step
    for req, (prompt, n) in zip(reqs, items, strict=True):
        assert req.output_ids == reference_output(prompt, n), req.rid
    stats = core.stats()
    assert stats["retractions"] > 0
    assert stats["computed_tokens"] > 0
    if mode == "swap":  # the buffer holds every victim: nothing is computed twice
        assert stats["swap_outs"] == stats["retractions"] and stats["swap_ins"] > 0
        assert stats["recomputed_tokens"] == 0 and stats["recompute_tax"] == 0.0
        assert stats["swapped_out_bytes"] >= stats["swapped_in_bytes"] > 0
        assert stats["swap_pages_used"] == 0  # every host page back once all are done
    else:
        assert "swap_outs" not in stats
        assert stats["recomputed_tokens"] > 0
        assert stats["recompute_tax"] == stats["recomputed_tokens"] / stats["computed_tokens"]


def test_a_full_swap_buffer_falls_back_to_recompute() -> None:
    # 2 host pages (8 tokens): most victims have computed more than that
    core, runner, clock = short_core(preemption_mode="swap", swap_space_bytes=8)
    items = workload(seed=3, n=24, max_out=64)
    reqs = submit(core, clock, items)
    drive(core, runner, clock)
    for req, (prompt, n) in zip(reqs, items, strict=True):
        assert req.output_ids == reference_output(prompt, n), req.rid
    stats = core.stats()
    assert stats["swap_full"] > 0 and stats["recomputed_tokens"] > 0
    assert stats["swap_outs"] + stats["swap_full"] == stats["retractions"]


def test_swap_in_copies_only_what_the_prefix_cache_lost() -> None:
    """Without a prefix cache every swapped page comes back by copy; with one, pages still in
    the tree are matched instead, so fewer bytes come back than went out."""
    totals = {}
    for cache in (False, True):
        core, runner, clock = short_core(
            preemption_mode="swap", swap_space_bytes=SWAP_BYTES, enable_prefix_cache=cache
        )
        items = workload(seed=3, n=24, max_out=64)
        reqs = submit(core, clock, items)
        drive(core, runner, clock)
        for req, (prompt, n) in zip(reqs, items, strict=True):
            assert req.output_ids == reference_output(prompt, n), req.rid
        stats = core.stats()
        totals[cache] = (stats["swapped_out_bytes"], stats["swapped_in_bytes"])
    assert totals[False][0] == totals[False][1]
    assert totals[True][1] < totals[True][0]


class NamesTheOldest(Policy):
    """Sends the request with the most outputs first when KV runs short."""

    name = "names-the-oldest"

    def preempt_candidates(
        self, candidate: Request | None, running: Sequence[Request], ctx: PolicyContext
    ) -> list[Request]:
        if candidate is None:
            return sorted(running, key=lambda r: -len(r.output_ids))[:1]
        return []


def test_the_policy_chooses_the_victim_on_kv_shortage() -> None:
    # 6 pages of 4 tokens: each request alone fits (4 + 20 tokens), both together do not
    core, runner, clock = short_core(
        num_pages=6,
        policy="tests.scheduler.test_preemption:NamesTheOldest",
        init_new_token_ratio=0.01,
        max_model_len=24,
    )
    (first,) = submit(core, clock, [([1, 2, 3, 4], 20)], tag="a")
    for _ in range(4):
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
    (second,) = submit(core, clock, [([9, 8, 7, 6], 20)], tag="b")
    while core.scheduler.retraction.total_retractions == 0:
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
    # the default rule ("newest") would have taken the second: the policy named the first
    assert (first.retractions, second.retractions) == (1, 0)
    drive(core, runner, clock)
    assert first.output_ids == reference_output([1, 2, 3, 4], 20)
    assert second.output_ids == reference_output([9, 8, 7, 6], 20)


class NamesAStranger(Policy):
    name = "names-a-stranger"

    def preempt_candidates(
        self, candidate: Request | None, running: Sequence[Request], ctx: PolicyContext
    ) -> list[Request]:
        return [Request("stranger", [1], SamplingParams(), 0.0)] if candidate is None else []


def test_a_policy_naming_a_request_that_is_not_running_is_replaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core, runner, clock = short_core(policy="tests.scheduler.test_preemption:NamesAStranger")
    reqs = submit(core, clock, workload(seed=3, n=24, max_out=64))
    drive(core, runner, clock)  # every request ends, the KV invariant held at every step
    assert all(r.output_ids == reference_output(r.prompt_ids, len(r.output_ids)) for r in reqs)
    assert core.scheduler.policy.name == "fcfs" and core.scheduler.policy_failures == 1
    assert any("stranger" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    swap_pages=st.integers(1, 64),
    rule=st.sampled_from(sorted(VICTIM_RULES)),
    cache=st.booleans(),
    host_tier=st.booleans(),
    aborts=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 15)), max_size=4),
)
def test_kv_invariant_holds_with_swaps_and_aborts(
    seed: int,
    swap_pages: int,
    rule: str,
    cache: bool,
    host_tier: bool,
    aborts: list[tuple[int, int]],
) -> None:
    """Random workloads on a short pool with a small swap buffer (and the host tier in it),
    requests aborted at random steps (swapped out or not): the page invariant (pool and host
    buffer) and each admitted prompt counted once in the hit and miss tokens after every step,
    exact outputs for those not aborted, and nothing held at the end."""
    core, runner, clock = short_core(
        num_pages=24,
        preemption_mode="swap",
        swap_space_bytes=swap_pages * 4,
        preemption_victim=rule,
        enable_prefix_cache=cache,
        host_kv_tier=host_tier and cache,
    )
    # each fits the pool alone (the engine refuses longer ones at intake)
    items = [(p, n) for p, n in workload(seed=seed, n=16, max_out=40) if len(p) + n <= 96]
    reqs = submit(core, clock, items)
    abort_at = dict(aborts)
    for step in range(1, 5000):
        if not core.has_work():
            break
        if step in abort_at:
            core.abort(reqs[abort_at[step] % len(reqs)].rid)
        plan = core.launch()
        if plan is not None:
            output = runner.execute(plan)
            clock.t += output.forward_seconds
            core.land(plan, output)
        core.kv.check_invariant()
        assert_counted_once(core, reqs)  # a step whose admissions all failed included
    assert not core.has_work()
    for req, (prompt, n) in zip(reqs, items, strict=True):
        if req.finish_reason != "abort":
            assert req.output_ids == reference_output(prompt, n), req.rid
    stats = core.stats()
    assert stats["pages_used"] == 0 and stats["swap_pages_used"] == 0
    assert not core.scheduler.retraction.swapped and not core.scheduler.retraction.recompute_until


def assert_counted_once(core: EngineCore, reqs: Sequence[Request]) -> None:
    """The hit and miss tokens are the prompts of the requests admitted so far, each once (not
    again when retracted and admitted again, nor for an admission that failed); the host
    tier's hits are some of those hits."""
    admitted = [req for req in reqs if req.first_scheduled_time is not None]
    kv = core.kv
    assert kv.hit_tokens + kv.miss_tokens == sum(len(req.prompt_ids) for req in admitted)
    assert kv.hit_tokens == sum(req.cached_tokens for req in admitted)
    assert kv.host_hit_tokens <= kv.hit_tokens


def test_the_simulator_charges_swaps_their_bytes_over_the_copy_bandwidth() -> None:
    from asyncengine.common.config import EngineConfig
    from asyncengine.sim.simulator import simulate
    from asyncengine.workloads import make_workload

    work = make_workload("random", num_requests=60, seed=2)
    config = EngineConfig(kv_cache_tokens=4096, preemption_mode="swap", log_interval=0)
    slow, fast = (
        simulate(config, work, swap_bytes_per_second=bandwidth) for bandwidth in (1e8, 1e10)
    )
    stats = slow.scheduler_stats
    moved = stats["swapped_out_bytes"] + stats["swapped_in_bytes"]
    assert stats["swap_outs"] > 0 and moved > 0
    assert stats["swap_seconds"] == pytest.approx(moved / 1e8)
    assert fast.scheduler_stats["swap_seconds"] < stats["swap_seconds"]
    assert stats["recomputed_tokens"] == 0


def test_preemption_and_predictor_keys_come_from_toml_and_the_command_line(
    tmp_path: Path,
) -> None:
    import argparse

    from asyncengine.cli import add_engine_arguments, engine_config_from_args
    from asyncengine.common.config import EngineConfig

    toml = tmp_path / "engine.toml"
    toml.write_text(
        'preemption_victim = "largest-kv"\npreemption_mode = "swap"\n'
        'swap_space_bytes = 65536\nlength_predictor = "history"\n'
        "[length_predictor_options]\nquantile = 0.75\n"
    )
    config = EngineConfig.from_toml(toml)
    assert (config.preemption_victim, config.preemption_mode) == ("largest-kv", "swap")
    assert config.length_predictor_options == {"quantile": 0.75}
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(
        ["--config", str(toml), "--preemption-victim", "least-computed",
         "--swap-space-bytes", "4096", "--length-predictor", "ranker"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert config.preemption_victim == "least-computed" and config.preemption_mode == "swap"
    assert config.swap_space_bytes == 4096 and config.length_predictor == "ranker"


class WatchesTheQueue(EvictionRule):
    """LRU that keeps the ids the scheduler hands it for each waiting request, step by step."""

    watches_queue = True

    def __init__(self) -> None:
        self.steps: list[list[Sequence[int]]] = []

    def watch_waiting(self, prompts: Sequence[Sequence[int]]) -> None:
        self.steps.append(list(prompts))


def test_a_retracted_request_waiting_is_read_without_a_copy_of_its_context_each_step() -> None:
    # 6 pages of 4 tokens: each request alone fits (4 + 20 tokens), both together do not
    core, runner, clock = short_core(
        num_pages=6,
        eviction_policy="tests.scheduler.test_preemption:WatchesTheQueue",
        init_new_token_ratio=0.01,
        max_model_len=24,
    )
    rule = core.kv.tree.rule
    assert isinstance(rule, WatchesTheQueue)
    (first,) = submit(core, clock, [([1, 2, 3, 4], 20)], tag="a")
    for _ in range(4):
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
    (second,) = submit(core, clock, [([9, 8, 7, 6], 20)], tag="b")
    while core.scheduler.retraction.total_retractions == 0:
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
    assert second.retractions == 1 and second.output_ids
    rule.steps.clear()
    while second.status is RequestStatus.WAITING:
        plan = core.launch()
        assert plan is not None
        core.land(plan, runner.execute(plan))
    # every step handed it its prompt and output; one list, joined once, not once a step
    handed = [ids for step in rule.steps for ids in step]
    assert len(handed) >= 5
    assert all(ids is handed[0] for ids in handed)
    assert list(handed[0]) == second.prompt_ids + second.output_ids
    drive(core, runner, clock)
    assert second.output_ids == reference_output([9, 8, 7, 6], 20)
