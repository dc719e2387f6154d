"""The simulator's LoRA: compute and adapter loads in the step cost, the adapter workloads,
max_loras in every simulated plan, and fairness to cold adapters under a hot one's flood."""

from __future__ import annotations

from collections import Counter

import pytest

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.routing import make_router
from asyncengine.sim.lora_cost import LoraCharges, LoraCostModel, LoraShape, SimLoras
from asyncengine.sim.lora_fairness import (
    DEFAULT_RUNS,
    fairness_table,
    lora_fairness,
    simulated,
)
from asyncengine.sim.multi_replica import MultiReplicaSimulator
from asyncengine.sim.simulator import Simulator, simulate
from asyncengine.workloads import make_workload
from asyncengine.workloads.adapters import adapter_mix, hot_adapter_flood, zipf_shares
from asyncengine.workloads.compact import CompactWorkload
from asyncengine.workloads.trace import WorkloadRequest

SHAPE = LoraShape(num_layers=2, modules=(("q", 4, 4), ("down", 8, 4)), bytes_per_weight=2)
COST = LoraCostModel(
    per_flop=1e-9, per_weight_byte=1e-6, per_adapter=1e-3, per_load=0.5, per_load_byte=1e-3
)


def plan(*rows: tuple[str, int], decodes: tuple[str, ...] = ()) -> BatchPlan:
    out = BatchPlan(step=1)
    out.extends = [Segment(rid, 0, [1] * n, 0, sample=True) for rid, n in rows]
    out.decodes = [Segment(rid, 0, [1], 5, sample=True) for rid in decodes]
    return out


def test_shape_counts_shrink_and_expand_per_row_and_the_adapter_bytes() -> None:
    # per layer: q 2*r*(4+4), down 2*r*(8+4) -> 40 r FLOPs, two layers: 80 r
    assert SHAPE.flops_per_row(3) == 240
    assert SHAPE.adapter_bytes(3) == 2 * 3 * (8 + 12) * 2


def request(rid: str, lora: str | None, arrival: float) -> Request:
    return Request(rid, [1, 2], SamplingParams(max_new_tokens=2, lora=lora), arrival)


def test_a_step_pays_its_rows_and_adapters_and_a_read_back_holds_its_requests() -> None:
    loras = SimLoras(ranks={"a": 2}, default_rank=4, max_cpu_loras=2, cost=COST, shape=SHAPE)
    charges = LoraCharges(loras, {"x": "a", "y": "b", "z": "a"})
    x, y, z = request("x", "a", 0.0), request("y", "b", 0.0), request("z", "a", 0.1)
    assert not charges.hold(request("base", None, 0.0))
    assert charges.hold(x) and charges.hold(y) and charges.hold(z)  # z waits for x's read
    a_ends = 0.5 + SHAPE.adapter_bytes(2) * 1e-3
    b_ends = 0.5 + SHAPE.adapter_bytes(4) * 1e-3
    assert charges.loads == 2 and charges.holding == 3
    assert charges.next_read_end() == pytest.approx(a_ends)
    assert charges.read_back(a_ends - 1e-6) == []
    assert charges.read_back(b_ends) == [x, z, y]  # in the order the reads end
    assert charges.holding == 0 and list(charges.resident) == ["a", "b"]
    assert charges.load_seconds == pytest.approx(a_ends + b_ends)
    assert not charges.hold(request("w", "a", 9.0))  # in memory now
    flops = 11 * SHAPE.flops_per_row(2) + 1 * SHAPE.flops_per_row(4)
    weights = SHAPE.adapter_bytes(2) + SHAPE.adapter_bytes(4)
    compute = flops * 1e-9 + weights * 1e-6 + 2 * 1e-3
    # the step pays its adapters' compute, not their reads
    assert charges.step_seconds(plan(("x", 10), ("base", 50), decodes=("y", "z"))) == pytest.approx(
        compute
    )
    assert charges.step_seconds(plan(("base", 7))) == 0.0
    assert charges.loads == 2
    # a driver that holds nothing has the step read what is not in memory
    direct = LoraCharges(loras, {"x": "a"})
    assert direct.step_seconds(plan(("x", 1))) == pytest.approx(
        SHAPE.flops_per_row(2) * 1e-9 + SHAPE.adapter_bytes(2) * 1e-6 + 1e-3 + a_ends
    )


def test_adapters_past_max_cpu_loras_go_least_recently_used_first_unless_in_flight() -> None:
    loras = SimLoras(max_cpu_loras=2, cost=COST, shape=SHAPE)
    in_flight: set[str] = set()
    charges = LoraCharges(loras, {"1": "a", "2": "b", "3": "c"}, in_flight)
    for rid in ("1", "2", "1", "3"):  # c drops b, the least recently used
        charges.step_seconds(plan((rid, 1)))
    assert list(charges.resident) == ["a", "c"] and charges.loads == 3
    charges.step_seconds(plan(("2", 1)))  # b comes back: read again, a goes
    assert list(charges.resident) == ["c", "b"] and charges.loads == 4
    # a step's own adapters are never dropped, even past the cap
    charges.step_seconds(plan(("1", 1), ("2", 1), ("3", 1)))
    assert list(charges.resident) == ["a", "b", "c"]
    # nor are those of requests in flight: a, the least recently used, stays for request 1
    in_flight.add("1")
    charges.step_seconds(plan(("2", 1)))
    assert list(charges.resident) == ["a", "b"]


def test_the_cost_model_fits_its_coefficients_and_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    truth = LoraCostModel(3e-12, 2e-11, 4e-3, 1e-3, 2e-9)
    compute = [
        (f, w, a, truth.compute_seconds(f, w, a))
        for f, w, a in [
            (10**9, 10**6, 1),
            (4 * 10**9, 10**6, 1),
            (10**9, 10**8, 2),
            (10**8, 10**7, 8),
        ]
    ]
    loads = [(n, truth.load_seconds(n)) for n in (10**6, 10**7, 10**8)]
    fitted = LoraCostModel.fit(compute, loads, "synthetic")
    for name in ("per_flop", "per_weight_byte", "per_adapter", "per_load", "per_load_byte"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    fitted.save(tmp_path / "m.json")
    assert LoraCostModel.load(tmp_path / "m.json") == fitted
    assert LoraCostModel.default().description.startswith("fitted")
    with pytest.raises(ValueError, match="per_flop"):
        LoraCostModel(per_flop=-1.0)


def test_adapters_cost_simulated_time_and_loads_are_counted() -> None:
    workload = adapter_mix(60, num_adapters=4, rate=50.0, seed=1)
    base = [WorkloadRequest(w.rid, w.arrival_time, w.prompt_ids, w.output_len) for w in workload]
    config = EngineConfig(log_interval=0, max_loras=4)
    with_loras = Simulator(config).run(workload)
    without = Simulator(config).run(base)
    assert with_loras.virtual_seconds > without.virtual_seconds
    assert with_loras.scheduler_stats["lora_loads"] == 4  # each adapter once: all stay held
    assert "lora_loads" not in without.scheduler_stats
    few = Simulator(config, loras=SimLoras(max_cpu_loras=4)).run(workload)
    assert few.scheduler_stats["lora_loads"] == 4
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        Simulator(config, loras=SimLoras(max_cpu_loras=2))


def test_no_simulated_plan_exceeds_max_loras() -> None:
    workload = adapter_mix(200, num_adapters=8, rate=40.0, base_share=0.2, seed=3)
    adapter = {w.rid: w.lora for w in workload}
    sim = Simulator(EngineConfig(log_interval=0, max_loras=2, policy="lpm"))
    widest = []

    def check(plan: BatchPlan) -> None:  # every landed step's plan
        widest.append(len({adapter[seg.rid] for seg in plan.segments} - {None}))

    sim.core.step_hooks.append(check)
    result = sim.run(workload)
    assert result.summary.num_completed == len(workload)
    assert max(widest) == 2  # the limit binds, and is kept
    assert result.core_stats["admission_blocked"]["lora_slots"] > 0


def test_adapter_mix_draws_zipf_popularity_and_is_seeded() -> None:
    workload = adapter_mix(4000, num_adapters=5, zipf_exponent=1.0, base_share=0.1, seed=7)
    assert workload == adapter_mix(4000, num_adapters=5, zipf_exponent=1.0, base_share=0.1, seed=7)
    counts = Counter(w.lora for w in workload)
    assert counts[None] == pytest.approx(400, rel=0.2)
    shares = zipf_shares(5, 1.0)
    on_adapters = len(workload) - counts[None]
    for i in range(5):
        assert counts[f"lora-{i}"] / on_adapters == pytest.approx(shares[i], abs=0.03)
    assert make_workload("adapter_mix", num_requests=10)[0].lora is not None


def test_the_flood_s_cold_requests_are_the_same_alone() -> None:
    flood = hot_adapter_flood(100, per_cold=5, seed=2)
    alone = hot_adapter_flood(100, per_cold=5, seed=2, include_hot=False)
    assert {w.lora for w in flood} == {"hot", *(f"cold-{j}" for j in range(7))}
    assert [w for w in flood if w.lora != "hot"] == alone
    assert sum(w.lora == "hot" for w in flood) == 100


def test_a_workload_s_adapter_round_trips_and_compact_refuses_it() -> None:
    item = WorkloadRequest("r", 0.5, [1, 2], 3, lora="a")
    assert WorkloadRequest.from_json(item.to_json()) == item
    assert "lora" not in WorkloadRequest("r", 0.5, [1, 2], 3).to_json()
    with pytest.raises(ValueError, match="LoRA"):
        CompactWorkload.from_requests([item])


@pytest.mark.parametrize(("seed", "max_loras"), [(0, 8), (1, 8), (0, 4)])
def test_lora_fair_keeps_cold_adapters_within_twice_their_latency_alone(
    seed: int, max_loras: int
) -> None:
    """With one hot adapter flooding and 7 cold ones, the cold adapters' p99 TTFT under
    lora-fair stays within 2x of their p99 alone, while fcfs leaves them behind the flood;
    with fewer LoRA slots than adapters too (lora-fair frees the flood's slot)."""
    fcfs, fair, _ = DEFAULT_RUNS
    rows = {
        row.label: row
        for row in lora_fairness([fcfs, fair], engine={"max_loras": max_loras}, seed=seed)
    }
    assert rows["lora-fair"].ratio <= 2.0, fairness_table(list(rows.values()))
    assert rows["fcfs"].ratio >= 10.0, fairness_table(list(rows.values()))
    # the flood still runs: the hot adapter is slowed, not stopped
    assert rows["lora-fair"].hot_output_throughput > 0.8 * rows["fcfs"].hot_output_throughput


def test_the_fairness_runner_starts_with_its_adapters_loaded_as_the_real_one_does() -> None:
    """The real runner loads every adapter before the first request: the simulated one pays
    no read back either, so the two compare the same thing."""
    workload = [WorkloadRequest("r", 0.0, list(range(1, 40)), 4, lora="a")]
    config = EngineConfig(log_interval=0)
    cold = simulate(config, workload).records[0].ttft
    loaded = simulate(config.replace(loras={"a": "a"}), workload).records[0].ttft
    assert cold is not None and loaded is not None and loaded < cold
    assert simulated()(config, workload).records[0].ttft == loaded


def test_replicas_charge_their_adapters_as_one_engine_does() -> None:
    workload = adapter_mix(40, num_adapters=3, rate=20.0, seed=5)
    base = [WorkloadRequest(w.rid, w.arrival_time, w.prompt_ids, w.output_len) for w in workload]
    config = EngineConfig(log_interval=0)
    one = MultiReplicaSimulator(config, 1, make_router("round-robin")).run(workload)
    assert one.virtual_seconds == pytest.approx(simulate(config, workload).virtual_seconds)
    plain = MultiReplicaSimulator(config, 1, make_router("round-robin")).run(base)
    assert one.virtual_seconds > plain.virtual_seconds


def test_a_live_trace_keeps_each_request_s_adapter(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from asyncengine.common.request import Request
    from asyncengine.common.sampling_params import SamplingParams
    from asyncengine.workloads.live_trace import load_live_trace
    from asyncengine.workloads.trace_recorder import TraceRecorder

    path = tmp_path / "live.jsonl"
    recorder = TraceRecorder(path, start=0.0, page_size=4, vocab_size=100)
    tuned = Request("a", [1, 2, 3], SamplingParams(max_new_tokens=2, lora="tuned"), 0.5)
    plain = Request("b", [4, 5], SamplingParams(max_new_tokens=3), 0.7)
    for req in (tuned, plain):
        recorder.arrival(req)
    recorder.close()
    requests = load_live_trace(path).requests
    assert [(r.prompt_ids, r.lora) for r in requests] == [([1, 2, 3], "tuned"), ([4, 5], None)]
