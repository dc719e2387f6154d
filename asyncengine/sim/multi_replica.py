"""Multi-replica simulation: N simulated engines behind one replica router, on virtual time.

Each replica is a full simulated engine (its own core, cost model and clock); the router is one
of asyncengine.routing's, the classes the Ray Serve deployment routes with, fed the same view
of each replica (requests in flight, prefix-cache capacity). Events run in time order: an
arrival is routed at its arrival time and joins its replica when that replica is next ready
(at once when idle, else when its step in flight lands), exactly as WorkloadReplay admits a
single engine's arrivals; so one replica behind any router gives the single simulator's run.
A request whose adapter is not in its replica's memory joins that replica's queue when the
adapter's read back ends (sim/lora_cost.py), an event like the others.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from asyncengine.bench.records import BenchSummary, RequestRecord, summarize
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, StepOutput
from asyncengine.common.request import Request
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from asyncengine.routing import ReplicaRouter, ReplicaState
from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.lora_cost import LoraCharges, SimLoras
from asyncengine.sim.simulated_executor import DEFAULT_SPEC, SAMPLED_TOKEN_ID, SimulatedExecutor
from asyncengine.sim.simulator import reveal_lengths
from asyncengine.sim.workload_replay import (
    SchedulerStuckError,
    held_retry,
    params_for,
    workload_records,
)
from asyncengine.workloads.trace import WorkloadRequest


@dataclass(slots=True)
class RoutedRequest:
    """One routing decision of the run."""

    rid: str
    replica: int  # index into MultiReplicaResult.replica_ids
    reason: str
    matched_tokens: int


@dataclass(slots=True)
class MultiReplicaResult:
    records: list[RequestRecord]  # one per workload request, in workload order
    summary: BenchSummary
    replica_ids: list[str]
    decisions: list[RoutedRequest]  # in routing (arrival) order; refused requests have none
    replica_stats: list[dict[str, float]]  # each replica's scheduler (and LoRA) stats
    router_decisions: dict[str, int]  # decisions by reason
    steps: int
    virtual_seconds: float
    wall_seconds: float


@dataclass(slots=True)
class _Replica:
    replica_id: str
    clock: VirtualClock
    executor: SimulatedExecutor
    core: EngineCore
    inbox: list[Request] = field(default_factory=list)  # routed, joins at the next ready time
    in_flight: tuple[BatchPlan, StepOutput | BaseException] | None = None
    steps: int = 0
    retry_at: float | None = None  # its policy holds every waiting request: try again then
    # choices 1..n-1 of a routed choice 0, which they follow (fork) into its replica's core
    followers: dict[str, list[Request]] = field(default_factory=dict)

    @property
    def ready_at(self) -> float:
        if self.in_flight is not None:
            return self.clock.now
        ready = math.inf if self.retry_at is None else self.retry_at
        lora = self.executor.lora
        read = None if lora is None else lora.next_read_end()
        return ready if read is None else min(ready, read)

    @property
    def holding(self) -> int:
        """Requests held for their adapter's read back."""
        return 0 if self.executor.lora is None else self.executor.lora.holding

    def state(self) -> ReplicaState:
        stats = self.core.kv.stats()
        capacity = int(stats["pages_total"]) * self.core.config.page_size
        load = len(self.core.scheduler.requests) + len(self.inbox) + self.holding
        return ReplicaState(self.replica_id, load, capacity)

    def admit(self) -> None:
        """Queue the routed requests (a request whose adapter is read back is held) and those
        whose adapter's read ended by now, in time order."""
        lora = self.executor.lora
        for req in self.inbox:
            if lora is not None:
                for ready in lora.read_back(req.arrival_time):
                    self._add(ready)
            if lora is None or not lora.hold(req):
                self._add(req)
        self.inbox.clear()
        if lora is not None:
            for ready in lora.read_back(self.clock.now):
                self._add(ready)

    def _add(self, req: Request) -> None:
        self.core.add(req, followers=self.followers.pop(req.rid, ()))

    def stats(self) -> dict[str, float]:
        stats = self.core.scheduler.stats()
        if self.executor.lora is not None:
            stats.update(self.executor.lora.stats())
        return stats

    def launch(self, more_to_arrive: bool) -> None:
        """Launch and run the next step; it lands when the clock reaches ready_at."""
        self.retry_at = None
        if self.in_flight is not None or not self.core.has_work():
            return
        plan = self.core.launch()
        if plan is None:  # nothing fits now (an arrival may change that) or the policy holds
            more = more_to_arrive or self.holding > 0
            self.retry_at = held_retry(self.core, self.clock.now, more)
            return
        try:
            output: StepOutput | BaseException = self.core.execute(plan)
        except Exception as error:  # lands as a failed step, like any driver's
            output = error
        self.in_flight = (plan, output)

    def land(self) -> None:
        """The step in flight lands (or, none in flight, the clock moves to ``ready_at``: a
        retry or the end of an adapter's read back)."""
        if self.in_flight is None:
            self.clock.advance_to(self.ready_at)
            return
        plan, output = self.in_flight
        self.in_flight = None
        self.core.land(plan, output)
        self.steps += 1


class MultiReplicaSimulator:
    """``num_replicas`` simulated engines of one ``config`` behind ``router``; run once."""

    def __init__(
        self,
        config: EngineConfig,
        num_replicas: int,
        router: ReplicaRouter,
        cost_model: CostModel | None = None,
        *,
        max_model_len: int | None = None,
        sampled_token_id: int = SAMPLED_TOKEN_ID,
        loras: SimLoras | None = None,
    ) -> None:
        """``loras``: as the Simulator's, for each replica (its own adapters in memory)."""
        if num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")
        spec = replace(
            DEFAULT_SPEC,
            max_model_len=max_model_len or config.max_model_len or DEFAULT_SPEC.max_model_len,
        )
        cost = cost_model or CostModel.default()
        if loras is not None:
            loras.check_fits(config.max_loras)
        self.router = router
        self.loras = loras
        self.replicas: list[_Replica] = []
        for i in range(num_replicas):
            clock = VirtualClock()
            executor = SimulatedExecutor(cost, clock, spec, sampled_token_id)
            core = build_core(config, executor, clock=clock)
            core.scheduler.stall_raises = True  # a simulation measures its policy, not FCFS
            if router.consumes_kv_events:
                core.kv.tree.record_events()
            self.replicas.append(_Replica(f"replica-{i}", clock, executor, core))
        self._used = False

    def run(self, workload: Sequence[WorkloadRequest]) -> MultiReplicaResult:
        if self._used:
            raise RuntimeError("a MultiReplicaSimulator runs one workload; make a new one")
        self._used = True
        adapters = {item.rid: item.lora for item in workload if item.lora is not None}
        for replica in self.replicas:
            reveal_lengths(replica.core, workload)
            if adapters:  # each replica loads and holds its own adapters
                loras = self.loras or SimLoras.for_config(replica.core.config.max_cpu_loras)
                in_flight = replica.core.scheduler.requests
                loaded = tuple(replica.core.config.loras)  # as each engine starts
                replica.executor.lora = LoraCharges(loras, adapters, in_flight, loaded)
        wall_start = time.perf_counter()
        pending = sorted(workload, key=lambda w: w.arrival_time)
        requests: dict[str, Request] = {}
        decisions: list[RoutedRequest] = []
        replicas = self.replicas
        index = {r.replica_id: i for i, r in enumerate(replicas)}
        max_len = replicas[0].core.max_model_len
        k = 0
        while True:
            next_arrival = pending[k].arrival_time if k < len(pending) else math.inf
            next_ready = min(r.ready_at for r in replicas)
            if next_arrival == math.inf and next_ready == math.inf:
                break
            if next_arrival <= next_ready:
                # every arrival at this instant is routed before any replica steps, as a single
                # engine admits all arrivals due before its next step
                now = next_arrival
                while k < len(pending) and pending[k].arrival_time == now:
                    item = pending[k]
                    k += 1
                    if not item.prompt_ids or len(item.prompt_ids) >= max_len:
                        continue  # the engine refuses it before queueing (no room to generate)
                    decision = self.router.route(
                        item.prompt_ids, [r.state() for r in replicas], now
                    )
                    target = index[decision.replica_id]
                    decisions.append(
                        RoutedRequest(item.rid, target, decision.reason, decision.matched_tokens)
                    )
                    params, prompt = params_for(item), list(item.prompt_ids)
                    req, *others = (Request(rid, prompt, params, now) for rid in item.choice_rids)
                    for choice in (req, *others):
                        requests[choice.rid] = choice
                    if others:
                        replicas[target].followers[req.rid] = others
                    replicas[target].inbox.append(req)
                for r in replicas:
                    if r.in_flight is None and r.inbox:
                        r.clock.advance_to(now)
                        r.admit()
                        r.launch(k < len(pending))
            else:
                for r in replicas:
                    if r.ready_at == next_ready:
                        r.land()
                        if self.router.consumes_kv_events:  # as a replica's publisher would
                            self.router.observe(r.replica_id, r.core.kv.tree.drain_events())
                        r.admit()
                        r.launch(k < len(pending))
        stuck = [r.replica_id for r in replicas if r.core.has_work()]
        if stuck:
            raise SchedulerStuckError(f"replicas {stuck} hold requests no step can serve")
        records = workload_records(workload, requests)
        stats = [r.stats() for r in replicas]
        return MultiReplicaResult(
            records=records,
            summary=summarize(records, retracts=int(sum(s["retractions"] for s in stats))),
            replica_ids=[r.replica_id for r in replicas],
            decisions=decisions,
            replica_stats=stats,
            router_decisions=dict(self.router.decisions),
            steps=sum(r.steps for r in replicas),
            virtual_seconds=max(r.clock.now for r in replicas),
            wall_seconds=time.perf_counter() - wall_start,
        )
