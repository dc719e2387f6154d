"""Both simulators hold a request whose adapter is not in memory out of the queue while the
adapter is read back, as the engine does (api/held_groups.py): the read delays that adapter's
requests alone, never a step, and each adapter in flight stays in memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from asyncengine.bench.records import RequestRecord
from asyncengine.common.config import EngineConfig
from asyncengine.core.engine_core import EngineCore
from asyncengine.routing import make_router
from asyncengine.sim.lora_cost import LoraCharges, LoraCostModel, SimLoras
from asyncengine.sim.multi_replica import MultiReplicaSimulator
from asyncengine.sim.simulator import Simulator
from asyncengine.workloads.adapters import adapter_mix
from asyncengine.workloads.trace import WorkloadRequest

READ_SECONDS = 10.0  # far past any step of these runs, so a step that paid one shows
COST = LoraCostModel(
    per_flop=1e-12, per_weight_byte=1e-12, per_adapter=1e-4, per_load=READ_SECONDS, per_load_byte=0
)
SIMULATORS = ("simulator", "multi_replica")


def loras(max_cpu_loras: int) -> SimLoras:
    return SimLoras(max_cpu_loras=max_cpu_loras, cost=COST)


def run(
    simulator: str,
    workload: Sequence[WorkloadRequest],
    sim_loras: SimLoras,
    config: EngineConfig | None = None,
    each_step: Callable[[EngineCore, LoraCharges], None] | None = None,
) -> tuple[list[RequestRecord], dict[str, float]]:
    """The records and stats of ``workload`` on ``simulator`` (one replica); ``each_step`` is
    called after every step with the core and its adapters."""
    config = config or EngineConfig(log_interval=0, policy="fcfs")
    if simulator == "simulator":
        single = Simulator(config, loras=sim_loras)
        core, executor = single.core, single.executor
    else:
        multi = MultiReplicaSimulator(config, 1, make_router("round-robin"), loras=sim_loras)
        core, executor = multi.replicas[0].core, multi.replicas[0].executor
    if each_step is not None:
        check = each_step

        def hook(_: object) -> None:
            assert executor.lora is not None
            check(core, executor.lora)

        core.step_hooks.append(hook)
    if simulator == "simulator":
        result = single.run(workload)
        return result.records, result.scheduler_stats
    replicas = multi.run(workload)
    return replicas.records, replicas.replica_stats[0]


def first_token(record: RequestRecord) -> float:
    assert record.token_times, record
    return record.token_times[0]


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_under_adapter_churn_no_step_pays_a_read_back(simulator: str) -> None:
    workload = adapter_mix(120, num_adapters=6, rate=1.0, base_share=0.2, seed=4)
    config = EngineConfig(log_interval=0, policy="fcfs", max_loras=2)
    records, stats = run(simulator, workload, loras(2), config)
    assert all(record.completed for record in records)
    assert stats["lora_loads"] > 6  # adapters dropped and read again
    assert stats["lora_load_seconds"] == pytest.approx(stats["lora_loads"] * READ_SECONDS)
    # every gap between two tokens of a running request is a step (or a wait for one)
    gaps = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    assert gaps and max(gaps) < READ_SECONDS / 2


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_a_read_back_delays_its_adapter_s_request_and_not_a_base_one(simulator: str) -> None:
    prompt = list(range(1, 33))
    workload = [
        WorkloadRequest("tuned", 0.0, prompt, 8, lora="a"),
        WorkloadRequest("base", 0.0, prompt[::-1], 8),
    ]
    records, stats = run(simulator, workload, loras(4))
    tuned, base = records
    assert base.ttft is not None and tuned.ttft is not None
    assert base.ttft < 1.0 and base.e2e is not None and base.e2e < READ_SECONDS
    assert READ_SECONDS <= tuned.ttft < READ_SECONDS + 0.5  # held for the read, then prefilled
    assert tuned.queue_time is not None and tuned.queue_time >= READ_SECONDS
    assert stats["lora_loads"] == 1


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_a_run_starts_with_the_configured_adapters_in_memory(simulator: str) -> None:
    """The engine reads the config's ``loras`` at start-up, in order, keeping the last
    ``max_cpu_loras``: a request for one of those waits for no read, one for a dropped one does."""
    prompt = list(range(1, 33))
    workload = [
        WorkloadRequest("kept", 0.0, prompt, 8, lora="c"),
        WorkloadRequest("dropped", 0.0, prompt[::-1], 8, lora="a"),
    ]
    paths = {name: f"adapters/{name}" for name in ("a", "b", "c")}
    config = EngineConfig(log_interval=0, policy="fcfs", loras=paths, max_loras=2, max_cpu_loras=2)
    records, stats = run(simulator, workload, loras(2), config)
    kept, dropped = records
    assert kept.ttft is not None and kept.ttft < 1.0
    assert dropped.ttft is not None and dropped.ttft >= READ_SECONDS
    assert stats["lora_loads"] == 1


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_requests_for_an_adapter_being_read_wait_for_the_same_read(simulator: str) -> None:
    prompt = list(range(1, 33))
    workload = [
        WorkloadRequest("first", 0.0, prompt, 8, lora="a"),
        WorkloadRequest("second", 2.0, prompt[::-1], 8, lora="a"),  # while "a" is read
    ]
    records, stats = run(simulator, workload, loras(4))
    assert stats["lora_loads"] == 1
    assert stats["lora_load_seconds"] == pytest.approx(READ_SECONDS)
    first, second = records
    # both join the queue when the one read ends, and are prefilled by the same step
    assert first_token(first) == first_token(second)
    assert READ_SECONDS <= first_token(first) < READ_SECONDS + 0.5


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_an_adapter_with_a_request_in_flight_stays_in_memory(simulator: str) -> None:
    workload = adapter_mix(120, num_adapters=6, rate=1.0, base_share=0.1, seed=9)
    config = EngineConfig(log_interval=0, policy="fcfs", max_loras=2)
    widest: list[int] = []

    def check(core: EngineCore, lora: LoraCharges) -> None:
        in_flight = {req.lora for req in core.scheduler.requests.values()} - {None}
        assert in_flight <= set(lora.resident), (in_flight, list(lora.resident))
        widest.append(len(in_flight))

    records, stats = run(simulator, workload, loras(2), config, check)
    assert max(widest) > 2  # more adapters in flight than max_cpu_loras: none of them dropped
    assert stats["lora_loads"] > 6
    assert all(record.completed for record in records)
