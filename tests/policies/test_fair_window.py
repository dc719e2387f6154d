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
