"""WorkloadReplay: a workload fed to an EngineCore at its arrival times, on a virtual clock.

The one driver of every virtual-clock run: the simulator (a SimulatedExecutor advances the
clock by the cost model) and the sim-vs-real replay (a TimedExecutor advances it by the
measured forward; with ``overhead_timer`` the replay also adds the measured scheduling and
commit time of each step). Each request generates exactly its ``output_len`` tokens, greedily.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncengine.bench.records import RequestRecord
from asyncengine.core import EngineCore
from asyncengine.plan import BatchPlan
from asyncengine.request import Request
from asyncengine.sampling_params import SamplingParams
from asyncengine.sim.bulk_decode import BulkDecode
from asyncengine.sim.clock import VirtualClock
from asyncengine.step_events import StepEvents
from asyncengine.workloads.trace import WorkloadRequest


def params_for(item: WorkloadRequest) -> SamplingParams:
    """Exactly ``output_len`` tokens, greedy: the same work whatever the model says; the
    request's scheduling controls (priority, tenant, timeout) as the workload gives them."""
    return SamplingParams(
        max_new_tokens=item.output_len,
        ignore_eos=True,
        temperature=0.0,
        priority=item.priority,
        tenant=item.tenant,
        timeout=item.timeout,
    )


class SchedulerStuckError(RuntimeError):
    """Requests wait, nothing more arrives, and the scheduler plans nothing."""


class WorkloadReplay:
    def __init__(
        self,
        core: EngineCore,
        clock: VirtualClock,
        workload: Sequence[WorkloadRequest],
        *,
        overhead_timer: Callable[[], float] | None = None,
        check_invariant_every: int = 0,
        bulk: BulkDecode | None = None,
    ) -> None:
        """``bulk``: run the steps it can with the decodes counted (sim/bulk_decode.py; a
        SimulatedExecutor's core only, same results)."""
        self.core = core
        self.clock = clock
        self.workload = workload
        self.overhead_timer = overhead_timer
        self.check_invariant_every = check_invariant_every
        self.bulk = bulk
        self.pending = sorted(workload, key=lambda w: w.arrival_time)
        self.next_arrival = 0
        self.requests: dict[str, Request] = {}
        self.plans: list[BatchPlan] = []  # kept when timed, for fitting cost models
        self.step_seconds: list[float] = []  # timed: forward + scheduling + commit of each step
        self.steps = 0
        self.peak_waiting = 0  # the most requests waiting before a step
        self.shared_params: dict[tuple[int, int, str | None, float | None], SamplingParams] = {}

    def done(self) -> bool:
        return self.next_arrival == len(self.pending) and not self.core.has_work()

    def _bulk_step(self) -> bool:
        """Run the next step in bulk if it can be (False: it runs step by step)."""
        bulk = self.bulk
        assert bulk is not None
        self._admit_arrivals()
        waiting = len(self.core.scheduler.waiting)
        if waiting > self.peak_waiting:
            self.peak_waiting = waiting
        if not bulk.step():
            bulk.flush()
            return False
        self.steps += 1
        if self.check_invariant_every and self.steps % self.check_invariant_every == 0:
            bulk.flush()
            self.core.check_invariant()
        return True

    def _admit_arrivals(self) -> None:
        pending, clock = self.pending, self.clock
        max_len = self.core.max_model_len
        shared_params = self.shared_params
        while (
            self.next_arrival < len(pending)
            and pending[self.next_arrival].arrival_time <= clock.now
        ):
            item = pending[self.next_arrival]
            self.next_arrival += 1
            if not item.prompt_ids or len(item.prompt_ids) >= max_len:
                continue  # the engine refuses it before queueing (no room to generate)
            # requests with the same controls share one validated (never changed) params
            key = (item.output_len, item.priority, item.tenant, item.timeout)
            params = shared_params.get(key)
            if params is None:
                params = shared_params[key] = params_for(item)
            req = Request(item.rid, list(item.prompt_ids), params, item.arrival_time)
            self.requests[item.rid] = req
            self.core.add(req)

    def step(self) -> StepEvents | None:
        """Let in what has arrived by now and run one step (waiting for arrivals if idle);
        None when the last requests ran out of time and nothing is left to run."""
        timer = self.overhead_timer
        while True:
            self._admit_arrivals()
            waiting = len(self.core.scheduler.waiting)
            if waiting > self.peak_waiting:
                self.peak_waiting = waiting
            start = timer() if timer is not None else 0.0
            result = self.core.step() if self.core.has_work() else None
            if result is not None:
                break
            if self.next_arrival == len(self.pending):
                if not self.core.has_work():
                    return None  # what waited has timed out
                raise SchedulerStuckError(
                    f"scheduler is stuck at t={self.clock.now:.3f}s: {self.core.stats()}"
                )
            self.clock.advance_to(self.pending[self.next_arrival].arrival_time)
        if timer is not None:
            spent = getattr(self.core.executor, "spent", 0.0)
            overhead = max(0.0, timer() - start - spent)
            self.clock.advance(overhead)
            assert result.plan is not None  # a step's events carry its plan
            self.plans.append(result.plan)
            self.step_seconds.append(result.forward_seconds + overhead)
        self.steps += 1
        if self.check_invariant_every and self.steps % self.check_invariant_every == 0:
            self.core.check_invariant()
        return result

    def run(self) -> list[RequestRecord]:
        bulk = self.bulk
        while not self.done():
            if bulk is not None and self._bulk_step():
                continue
            if self.step() is None:
                break
        if bulk is not None:
            bulk.flush()
        return self.records()

    def records(self) -> list[RequestRecord]:
        """One record per workload request, in workload order."""
        return workload_records(self.workload, self.requests)


def workload_records(
    workload: Sequence[WorkloadRequest], requests: dict[str, Request]
) -> list[RequestRecord]:
    """One record per workload request, in workload order; ``requests`` holds those admitted."""
    records = []
    for item in workload:
        record = RequestRecord(item.rid, item.arrival_time, len(item.prompt_ids))
        req = requests.get(item.rid)
        if req is None:  # refused at arrival
            record.failed = True
            record.finish_time = item.arrival_time
        else:
            record.token_times = req.token_times
            record.finish_time = req.finished_time
            record.cached_tokens = req.cached_tokens
            record.retracts = req.retractions
            record.failed = req.finish_reason == "abort"
            record.timed_out = req.finish_reason == "timeout"
            record.blocked = dict(req.blocked)
        record.tenant = item.tenant
        record.priority = item.priority
        records.append(record)
    return records
