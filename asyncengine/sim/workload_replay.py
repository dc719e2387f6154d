"""WorkloadReplay: a workload fed to an EngineCore at its arrival times, on a virtual clock.

The one driver of every virtual-clock run: the simulator (a SimulatedExecutor advances the
clock by the cost model) and the sim-vs-real replay (a TimedExecutor advances it by the
measured forward; with ``overhead_timer`` the replay also adds the measured scheduling and
commit time of each step). Each request generates exactly its ``output_len`` tokens, greedily;
one with n choices runs as the engine runs it: choice 0, then the others forking its prompt
pages (each choice is a request of the run, records included).
With ``lora``, a request whose adapter is not in memory joins the queue when its read back ends
(sim/lora_cost.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from mypy_extensions import mypyc_attr

from asyncengine.bench.records import RequestRecord
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.engine_core import EngineCore
from asyncengine.scheduler.policy_guard import IDLE_POLL_SECONDS, stalled_error
from asyncengine.scheduler.step_events import StepEvents
from asyncengine.sim.bulk_decode import BulkDecode
from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.lora_cost import LoraCharges
from asyncengine.workloads.compact import CompactWorkload
from asyncengine.workloads.trace import WorkloadRequest

# a request's controls, which its params are made from: output length, priority, tenant,
# timeout, adapter, cache salt, choices
ParamsKey = tuple[int, int, str | None, float | None, str | None, str | None, int]

_FIRST_SWEEP = 4096  # unswept requests before the first sweep (keep_requests=False)
# token ids below this share one int object each across every prompt made from a compact
# workload (past it, each prompt holds its own)
_SHARED_TOKEN_IDS = 1 << 20


def params_for(item: WorkloadRequest) -> SamplingParams:
    """Exactly ``output_len`` tokens, greedy: the same work whatever the model says; the
    request's scheduling controls (priority, tenant, timeout), adapter, cache salt and
    choices as the workload gives them."""
    return controls_params(
        item.output_len, item.priority, item.tenant, item.timeout, item.lora,
        item.cache_salt, item.n,
    )  # fmt: skip


def controls_params(
    output_len: int,
    priority: int,
    tenant: str | None,
    timeout: float | None,
    lora: str | None = None,
    cache_salt: str | None = None,
    n: int = 1,
) -> SamplingParams:
    """``params_for`` from the controls themselves."""
    return SamplingParams(
        max_new_tokens=output_len,
        ignore_eos=True,
        temperature=0.0,
        priority=priority,
        tenant=tenant,
        timeout=timeout,
        lora=lora,
        cache_salt=cache_salt,
        n=n,
    )


def shared_token_ints(workload: CompactWorkload) -> np.ndarray | None:
    """An object array whose item ``t`` is the int ``t``, for every token id of ``workload``:
    indexed by a prompt's ids, its ``tolist()`` is the prompt as a list whose items are these
    shared ints. A prompt held so costs 8 bytes a token instead of ~36 (an int object each):
    the waiting queue of an overloaded million-request run holds hundreds of thousands of
    prompts. None when the ids reach past ``_SHARED_TOKEN_IDS`` (then each holds its own)."""
    tokens = workload.tokens
    if not tokens.size:
        return None
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= _SHARED_TOKEN_IDS:
        return None
    ints = np.empty(high + 1, dtype=object)
    ints[:] = range(high + 1)
    return ints


@mypyc_attr(native_class=False)  # mypyc compiles only some builtin bases
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
        keep_requests: bool = True,
        lora: LoraCharges | None = None,
    ) -> None:
        """``bulk``: run the steps it can with the decodes counted (sim/bulk_decode.py; a
        SimulatedExecutor's core only, same results). ``keep_requests=False``: a finished
        request is kept as its record only (its prompt and outputs let go, for runs of
        millions of requests); ``requests`` then holds the unfinished ones. ``lora``: the
        adapters in memory, which hold an arrival until its adapter is read back."""
        self.core = core
        self.clock = clock
        # a policy that holds past max_policy_stall is an error here, not a switch to FCFS
        core.scheduler.stall_raises = True
        self.workload = workload
        self.overhead_timer = overhead_timer
        self.check_invariant_every = check_invariant_every
        self.bulk = bulk
        self.lora = lora
        # a compact workload stays arrays: each request is made when it arrives
        self.compact = workload.by_arrival() if isinstance(workload, CompactWorkload) else None
        self.pending: Sequence[WorkloadRequest] = (
            self.compact
            if self.compact is not None
            else sorted(workload, key=lambda w: w.arrival_time)
        )
        self.arrival_times: list[float] = (
            self.compact.arrival_times.tolist()
            if self.compact is not None
            else [w.arrival_time for w in self.pending]
        )
        # a compact workload's columns as Python numbers, read once per arrival
        self._starts: list[int] = [] if self.compact is None else self.compact.starts.tolist()
        self._output_lens: list[int] = (
            [] if self.compact is None else self.compact.output_lens.tolist()
        )
        self._token_ints = None if self.compact is None else shared_token_ints(self.compact)
        self.next_arrival = 0
        self.requests: dict[str, Request] = {}
        self.keep_requests = keep_requests
        self.finished_records: dict[str, RequestRecord] = {}  # keep_requests=False only
        self._unswept: list[Request] = []  # arrived since the last sweep, or unfinished then
        self._sweep_at = _FIRST_SWEEP
        self.plans: list[BatchPlan] = []  # kept when timed, for fitting cost models
        self.step_seconds: list[float] = []  # timed: forward + scheduling + commit of each step
        self.steps = 0
        self.peak_waiting = 0  # the most requests waiting before a step
        self.shared_params: dict[ParamsKey, SamplingParams] = {}
        self.followers: dict[str, list[Request]] = {}  # choices 1..n-1 of a held choice 0

    def done(self) -> bool:
        return (
            self.next_arrival == len(self.arrival_times)
            and not self.core.has_work()
            and not self._holding()
        )

    def _holding(self) -> bool:
        """Some request waits for its adapter's read back."""
        return self.lora is not None and self.lora.holding > 0

    def _queue_read_back(self, until: float) -> None:
        """Queue the requests whose adapter's read ended by ``until``."""
        if self.lora is not None:
            for req in self.lora.read_back(until):
                self.core.add(req, followers=self.followers.pop(req.rid, ()))

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
        times, now = self.arrival_times, self.clock.now
        if self.next_arrival == len(times) or times[self.next_arrival] > now:
            if self._holding():
                self._queue_read_back(now)
            return
        compact, pending, lora = self.compact, self.pending, self.lora
        max_len = self.core.max_model_len
        while self.next_arrival < len(times) and times[self.next_arrival] <= now:
            index = self.next_arrival
            self.next_arrival += 1
            if lora is not None and lora.holding:  # reads ended before this arrival go first
                self._queue_read_back(times[index])
            if compact is not None:
                start, end = self._starts[index], self._starts[index + 1]
                if start == end or end - start >= max_len:
                    continue  # the engine refuses it before queueing (no room to generate)
                rid = compact.rids[index]
                tenant = None if compact.tenants is None else compact.tenants[index]
                key: ParamsKey = (
                    self._output_lens[index],
                    compact.priority(index),
                    tenant,
                    compact.timeout(index),
                    None,
                    None,
                    1,
                )
                ids = compact.tokens[start:end]
                ints = self._token_ints
                # ``take`` gives what fancy indexing gives, in ~60% of its time
                prompt = ids.tolist() if ints is None else ints.take(ids).tolist()
            else:
                item = pending[index]
                if not item.prompt_ids or len(item.prompt_ids) >= max_len:
                    continue  # the engine refuses it before queueing (no room to generate)
                rid = item.rid
                key = (
                    item.output_len, item.priority, item.tenant, item.timeout, item.lora,
                    item.cache_salt, item.n,
                )  # fmt: skip
                prompt = list(item.prompt_ids)
                if item.n > 1:
                    self._admit_choices(item, prompt, self._params(key), times[index])
                    continue
            req = Request(rid, prompt, self._params(key), times[index])
            self._admit(req, ())
        if lora is not None and lora.holding:
            self._queue_read_back(now)
        if len(self._unswept) >= self._sweep_at:
            self._sweep()

    def _admit_choices(
        self, item: WorkloadRequest, prompt: list[int], params: SamplingParams, now: float
    ) -> None:
        """Queue ``item``'s n choices as the engine does: the others follow choice 0."""
        leader, *others = (Request(rid, prompt, params, now) for rid in item.choice_rids)
        for follower in others:
            self.requests[follower.rid] = follower
            if not self.keep_requests:
                self._unswept.append(follower)
        self._admit(leader, others)

    def _admit(self, req: Request, followers: Sequence[Request]) -> None:
        """Queue ``req`` (and the choices that follow it), or hold it for its adapter."""
        self.requests[req.rid] = req
        if not self.keep_requests:
            self._unswept.append(req)
        lora = self.lora
        if lora is None or not lora.hold(req):
            self.core.add(req, followers=followers)
        elif followers:
            self.followers[req.rid] = list(followers)

    def _params(self, key: ParamsKey) -> SamplingParams:
        """Requests with the same controls share one validated (never changed) params."""
        params = self.shared_params.get(key)
        if params is None:
            params = self.shared_params[key] = controls_params(*key)
        return params

    def _sweep(self) -> None:
        """Keep the finished requests as records only (``keep_requests=False``); sweeps when
        the unswept have doubled, so each request is looked at a few times at most."""
        still: list[Request] = []
        for req in self._unswept:
            if req.finished:
                del self.requests[req.rid]
                self.finished_records[req.rid] = request_record(
                    req.rid, req.arrival_time, len(req.prompt_ids), req
                )
            else:
                still.append(req)
        self._unswept = still
        self._sweep_at = max(_FIRST_SWEEP, 2 * len(still))

    def step(self) -> StepEvents | None:
        """Let in what has arrived by now and run one step (waiting for arrivals, or for a
        policy that holds, if idle); None when the last requests ran out of time and nothing
        is left to run."""
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
            wake = self._next_event()
            if wake is None:
                if not self.core.has_work():
                    return None  # what waited has timed out
                raise SchedulerStuckError(
                    f"scheduler is stuck at t={self.clock.now:.3f}s"
                    f"{stuck_reason(self.core)}: {self.core.stats()}"
                )
            self.clock.advance_to(wake)
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

    def _next_event(self) -> float | None:
        """When a step that ran nothing should be tried again: the next arrival or end of an
        adapter's read back, or sooner while the policy holds (``held_retry``). None: never."""
        times = self.arrival_times
        joins = times[self.next_arrival] if self.next_arrival < len(times) else None
        if self.lora is not None:
            read = self.lora.next_read_end()
            if read is not None and (joins is None or read < joins):
                joins = read
        retry = held_retry(self.core, self.clock.now, joins is not None)
        if retry is None:  # not held by the policy: only a request joining changes things
            return joins
        return retry if joins is None else min(retry, joins)

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
        """One record per workload request's choice, in workload order."""
        return workload_records(self.workload, self.requests, self.finished_records)


def held_retry(core: EngineCore, now: float, more_to_arrive: bool) -> float | None:
    """When to try again a step that ran nothing because the policy held every waiting
    request while nothing ran: ``EngineCore.held_until`` (the policy's wake time, a waiting
    request's deadline or the end of ``max_policy_stall``, whichever comes first), or without
    a wake time the engine's next idle poll (or a deadline before it). None: the policy holds
    nothing. With nothing ``more_to_arrive``, no deadline, no wake time and no bound, the
    polls would never end: PolicyStalledError."""
    sched = core.scheduler
    if sched.stall.since is None:
        return None
    until = core.held_until()
    if until is not None:
        return until
    deadline = core.lifecycle.next_deadline()  # a waiting request may time out first
    if deadline is not None and deadline <= now:
        deadline = None
    if not more_to_arrive and deadline is None and not sched.config.max_policy_stall:
        raise stalled_error(sched.policy, now - sched.stall.since, list(sched.waiting))
    wake = now + IDLE_POLL_SECONDS
    return wake if deadline is None else min(wake, deadline)


def stuck_reason(core: EngineCore) -> str:
    """What blocks admission while nothing runs, when the policy is not why (an empty string
    when nothing is known)."""
    reason = core.scheduler.idle_block.reason
    return "" if reason is None else f" (admission blocked by {reason}, not by the policy)"


def request_record(
    rid: str, arrival_time: float, prompt_tokens: int, req: Request | None
) -> RequestRecord:
    """What ``req`` went through (None: refused at arrival); tenant, priority and adapter
    are the workload's, set by the caller."""
    if req is None:
        return RequestRecord(
            rid, arrival_time, prompt_tokens, failed=True, finish_time=arrival_time
        )
    reason = req.finish_reason
    scheduled = req.first_scheduled_time
    return RequestRecord(
        rid,
        arrival_time,
        prompt_tokens,
        req.token_times,
        req.finished_time,
        req.cached_tokens,
        reason == "abort",
        req.retractions,
        reason == "timeout",
        blocked=dict(req.blocked),
        queue_time=None if scheduled is None else scheduled - req.arrival_time,
    )


def workload_records(
    workload: Sequence[WorkloadRequest],
    requests: dict[str, Request],
    finished: dict[str, RequestRecord] | None = None,
) -> list[RequestRecord]:
    """One record per workload request's choice, in workload order; ``requests`` holds those
    admitted (``finished``: the records of those already let go, WorkloadReplay's
    keep_requests)."""
    done = finished or {}
    records = []
    no_lora: str | None = None  # a compact workload holds no adapters
    if isinstance(workload, CompactWorkload):
        lens = workload.prompt_lens().tolist()
        times = workload.arrival_times.tolist()
        rows = (
            (
                rid,
                times[i],
                lens[i],
                None if workload.tenants is None else workload.tenants[i],
                workload.priority(i),
                no_lora,
            )
            for i, rid in enumerate(workload.rids)
        )
    else:
        rows = (
            (
                rid,
                item.arrival_time,
                len(item.prompt_ids),
                item.tenant,
                item.priority,
                item.lora,
            )
            for item in workload
            for rid in item.choice_rids
        )
    for rid, arrival, prompt_tokens, tenant, priority, lora in rows:
        record = done.get(rid)
        if record is None:
            record = request_record(rid, arrival, prompt_tokens, requests.get(rid))
        record.tenant = tenant
        record.priority = priority
        record.lora = lora
        records.append(record)
    return records
