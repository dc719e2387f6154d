"""fair's per-tenant candidates in the engine: a window full of one tenant hides no other."""

from __future__ import annotations

from asyncengine.common.config import EngineConfig
from asyncengine.sim import CostModel, Simulator
from asyncengine.workloads import WorkloadRequest


def test_fair_admits_a_light_tenant_behind_a_window_full_of_a_heavy_one() -> None:
    def item(rid: str, t: float, tenant: str) -> WorkloadRequest:
        return WorkloadRequest(rid, t, list(range(7, 7 + 64)), 32, tenant=tenant)

    heavy = [item(f"h{i:03d}", 0.0, "heavy") for i in range(200)]
    workload = [*heavy, item("light", 0.001, "light")]
    config = EngineConfig(policy_window=8, max_running_requests=4, kv_cache_tokens=4096)
    finish = {}
    for policy in ("fcfs", "fair"):
        result = Simulator(config.replace(policy=policy), CostModel.default()).run(workload)
        done = {r.rid: r.finish_time for r in result.records}
        finish[policy] = sorted(done, key=lambda rid: done[rid]).index("light")
    assert finish["fcfs"] > 190  # behind the whole heavy backlog
    assert finish["fair"] < 10  # its head was among the candidates from the start


def test_fair_forgets_idle_tenants_past_its_cap_and_they_come_back_at_the_floor() -> None:
    """Tenant names come from clients: a stream of fresh names must not grow the state."""
    from typing import Any, cast

    from asyncengine.common.request import Request
    from asyncengine.common.sampling_params import SamplingParams
    from asyncengine.policies.base import PolicyContext
    from policies.fair import FairPolicy

    policy = FairPolicy(max_idle_tenants=8)
    ctx = cast(PolicyContext, None)  # fair's ordering reads no context

    def arrive(rid: str, tenant: str) -> Request:
        req = Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=4, tenant=tenant), 0.0)
        policy.order([req], ctx)
        return req

    steady = arrive("steady", "steady")  # stays active throughout
    policy.counters["steady"] = 500.0
    for i in range(1000):
        req = arrive(f"r{i}", f"user-{i}")
        policy.counters[f"user-{i}"] += 1000.0  # served a lot, then idle
        policy.finished(req)
    state: dict[str, Any] = {"counters": policy.counters, "live": policy._live}
    for name, table in state.items():
        assert len(table) <= 8 + 1, (name, len(table))  # the cap, and the active tenant
    assert "user-0" not in policy.counters and "user-999" in policy.counters
    # a forgotten tenant comes back as a new one: at the active floor, not at 0
    arrive("again", "user-0")
    assert policy.counters["user-0"] == 500.0
    # one remembered keeps its own higher counter (lifted to the floor of 500, then served 1000)
    arrive("again2", "user-999")
    assert policy.counters["user-999"] == 1500.0
    policy.finished(steady)
