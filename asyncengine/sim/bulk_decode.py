"""BulkDecode: simulated steps whose decodes are counted, not written one request at a time.

In a simulated run a decoding request's step is always the same: one more KV slot (a new page
every ``page_size`` tokens), the simulated token appended, the step's end time stamped, and its
length stop checked. Done per running request per step in Python that is nearly all of a large
simulation's time. ``BulkDecode`` runs the same steps with the decoding requests' progress kept
as counts: each request's length at step ``j`` is ``base + j``, so the step's cost (the summed
decode context), the reserved future tokens of admission, the requests that need a page this
step (those whose length is a multiple of the page size: one bucket per remainder) and the
step at which each reaches its length are all known without touching the others. Only those
that need a page (a real ``KVCacheManager.extend``, in running order, as the real step does)
and those that end (written back, then ended by the lifecycle) are touched; everything else
about the step (arrivals, the policy's budget and order, admission, prefill chunks, the
admission counts, ``new_token_ratio``, the virtual clock) runs the scheduler's own code.
``flush`` writes the counts back into the requests (output tokens, token times, KV lengths).

The results are the step-by-step simulator's, exactly (tests/sim/test_bulk_decode.py compares every
request's record and the run's counters on traces with chunking, preemption, the prefix cache
and timeouts). A step is run step by step instead (after a ``flush``) when anything would read
or change a decoding request: KV shortage (retraction), a deadline due, a policy swap pending,
a step hook or shadow, speculation, a policy that preempts or that sees decodes
(``Policy.sees_decodes``), a request that could stop by a token or a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncengine.cache.manager import SeqKV
from asyncengine.common.plan import BatchPlan, StepOutput, TokenLogprobs
from asyncengine.common.request import Request, RequestStatus
from asyncengine.core.engine_core import EngineCore
from asyncengine.policies.base import Policy
from asyncengine.scheduler.admission import DECODE_TURN, Admission
from asyncengine.sim.closed_admission import closed_admission
from asyncengine.sim.simulated_executor import SimulatedExecutor

# bulk steps kept before a flush trims the shared list of step times
_MAX_TIMES = 20_000


@dataclass(slots=True)
class _Decoding:
    """A running request whose progress is counted: before the decode of bulk step ``j`` its
    KV holds ``base + j`` tokens; its bulk tokens are stamped ``times[first:]``; it gets its
    last token at step ``last``."""

    req: Request
    seq: SeqKV  # its KV handle (the same while it is counted: only a retraction changes it)
    order: int  # its place in the running queue (joins append, as the scheduler's)
    base: int
    future_base: int  # future tokens before step j: future_base - j
    first: int
    last: int


class BulkDecode:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        executor = core.executor
        if not isinstance(executor, SimulatedExecutor):
            raise TypeError("bulk decoding needs the simulated executor")
        self.executor = executor
        self.token = executor.sampled_token_id
        self.page_size = core.kv.page_size
        self.active = False
        self.times: list[float] = []  # end time of each bulk step since the last flush
        self.members: dict[int, _Decoding] = {}  # id(request) ->
        self.buckets: dict[int, list[_Decoding]] = {}  # base % page_size -> in running order
        self.lasts: dict[int, list[_Decoding]] = {}  # bulk step -> those it ends
        self.sum_base = 0
        self.sum_future = 0
        self._order = 0
        self.empty_plan = BatchPlan(step=0)  # for closed_admission, which leaves it empty
        self.bulk_steps = 0  # steps run in bulk, over the whole run
        # of those, the quiet ones (nothing but decodes), by why admission stopped
        # ("+window": after the policy's window was taken)
        self.quiet_steps: dict[str, int] = {}

    # -- when -----------------------------------------------------------------------------
    def _step_allowed(self) -> bool:
        core = self.core
        sched = core.scheduler
        policy = sched.policy
        if (
            core.step_hooks
            or sched.shadow is not None
            or sched._next_policy is not None
            or sched.speculation is not None
            or not sched.config.enable_mixed_batch
            or policy.preempts
            or policy.sees_decodes
        ):
            return False
        deadline = core.lifecycle.next_deadline()
        return deadline is None or deadline > sched.clock()

    def _plain(self, req: Request) -> bool:
        """Only its length can end it, and its KV holds exactly the pages its length needs."""
        params = req.params
        seq = req.seq
        token = self.token
        return (
            req.status is RequestStatus.RUNNING
            and seq is not None
            and req.text is None
            and req.grammar is None
            and not req.prefill_only
            and token not in params.stop_token_set
            and (params.ignore_eos or token not in self.core.lifecycle.eos_token_ids)
            and len(seq.pages) == -(-seq.kv_len // self.page_size)
            and req.rid not in self.core.lifecycle.followers
        )

    def _start(self) -> bool:
        running = self.core.scheduler.running
        if not running or not all(self._plain(req) for req in running):
            return False
        self.active = True
        self.core.scheduler.running_future_tokens = self._future_tokens
        for req in running:
            self._join(req)
        return True

    # -- the counts -----------------------------------------------------------------------
    def _join(self, req: Request) -> None:
        """``req`` decodes from the next bulk step on."""
        j = len(self.times)
        seq = req.kv
        future = req.future_tokens(self.core.max_model_len)
        member = _Decoding(
            req,
            seq,
            self._order,
            base=seq.kv_len - j,
            future_base=future + j,
            first=j,
            last=j + future - 1,
        )
        self._order += 1
        self.members[id(req)] = member
        self.buckets.setdefault(member.base % self.page_size, []).append(member)
        self.lasts.setdefault(member.last, []).append(member)
        self.sum_base += member.base
        self.sum_future += member.future_base

    def _future_tokens(self) -> int:
        """The decoding requests' future tokens now (Scheduler._reserved_tokens asks)."""
        return self.sum_future - len(self.times) * len(self.members)

    def _write_back(self, member: _Decoding) -> None:
        req, j = member.req, len(self.times)
        count = j - member.first
        if count:
            req.output_ids.extend([self.token] * count)
            req.token_times.extend(self.times[member.first :])
        seq = req.kv
        seq.kv_len = seq.computed_len = member.base + j

    def _leave(self, member: _Decoding) -> None:
        del self.members[id(member.req)]
        self.buckets[member.base % self.page_size].remove(member)
        self.sum_base -= member.base
        self.sum_future -= member.future_base

    def flush(self) -> None:
        """Write every counted request's progress back; the next step starts afresh."""
        if not self.active:
            return
        for member in self.members.values():
            self._write_back(member)
        self.members.clear()
        self.buckets.clear()
        self.lasts.clear()
        self.times = []
        self.sum_base = self.sum_future = 0
        self.core.scheduler.running_future_tokens = None
        self.active = False

    # -- one step -------------------------------------------------------------------------
    def step(self) -> bool:
        """Run the next step in bulk; False (and nothing done) when it must run step by step
        (the caller flushes and runs it so). Arrivals are the caller's, as before any step."""
        if not self._step_allowed():
            return False
        if not self.active:
            if not self._start():
                return False
        elif not self.members or len(self.times) >= _MAX_TIMES:
            return False
        core, sched, kv = self.core, self.core.scheduler, self.core.kv
        j = len(self.times)
        need = self.buckets.get(-j % self.page_size)
        if need:  # their next token starts a page: allocated in running order
            if len(need) > kv.available_pages:
                return False  # retraction: the step-by-step path's
            seqs = []
            for member in need:
                seq = member.seq
                seq.kv_len = member.base + j
                seqs.append(seq)
            kv.extend_each_by_one(seqs)
        num_decodes = len(self.members)
        if j not in self.lasts and self._quiet_step(num_decodes):
            return True
        plan = self._plan(num_decodes)
        # a decode at length base + j attends from start position base + j
        forward = self.executor.bulk_seconds(plan, num_decodes, self.sum_base + j * num_decodes)
        ending = self.lasts.pop(j, None)
        lifecycle = core.lifecycle
        if not plan.extends and ending is None:
            self._land_quiet(plan, forward)
            self.times.append(sched.clock())
            lifecycle.counters["generated_tokens"] += num_decodes
            self.bulk_steps += 1
            return True
        output = self._execute(plan, forward)
        core.land(plan, output)  # the extends' tokens, their ends, the policy's observe
        sched.retraction.total_computed_tokens += num_decodes
        self.times.append(sched.clock())
        lifecycle.counters["generated_tokens"] += num_decodes
        for member in sorted(ending or (), key=_by_order):
            self._write_back(member)
            self._leave(member)
            lifecycle.end(member.req, "length")
        uncounted = False
        for seg in plan.extends:  # prompts done this step decode from the next one on
            req = sched.requests.get(seg.rid)
            if seg.sample and req is not None and req.status is RequestStatus.RUNNING:
                if self._plain(req):
                    self._join(req)
                else:
                    uncounted = True
        core.events()  # the simulator reads records, not events
        self.bulk_steps += 1
        if uncounted:  # one that must decode step by step joined: the next steps go so
            self.flush()
        return True

    def _quiet_step(self, num_decodes: int) -> bool:
        """Run the step if it is nothing but its counted decodes, ending no request, with an
        admission that ``closed_admission`` tells without running it: the scheduler's counts
        and ratio, the clock, the policy's observe as ``_plan`` and ``_land_quiet`` would
        leave them. False (nothing done) when the step must be planned."""
        core = self.core
        sched = core.scheduler
        kv = sched.kv
        if kv.swap is not None:
            return False
        admission = closed_admission(sched, num_decodes, self.empty_plan)
        if admission is None:
            return False
        # Scheduler.begin_step and end_step for a plan that would hold only decodes
        sched.step_count += 1
        if sched.step_guesses:
            sched.step_guesses = {}
        sched.count_step(False, True)
        sched.admission.record(sched.waiting, admission)
        kv.page_table.drain_writes()  # the simulated executor keeps no page table
        # a decode at length base + j attends from start position base + j
        j = len(self.times)
        seconds = self.executor.cost_model.seconds(
            0, 0, num_decodes, self.sum_base + j * num_decodes + num_decodes
        )
        self.executor.clock.advance(seconds)
        sched.retraction.total_computed_tokens += num_decodes
        policy = sched.policy
        if type(policy).observe is not Policy.observe:
            policy.observe(BatchPlan(step=sched.step_count), seconds)
        self.times.append(sched.clock())
        core.lifecycle.counters["generated_tokens"] += num_decodes
        self.bulk_steps += 1
        reason = f"{admission.stopped}+window" if admission.window else str(admission.stopped)
        self.quiet_steps[reason] = self.quiet_steps.get(reason, 0) + 1
        return True

    def _plan(self, num_decodes: int) -> BatchPlan:
        """Scheduler.schedule with mixed batches, its decodes counted: the same steps of the
        scheduler (the budget, admission, counts and ratio), the plan's extends only."""
        sched = self.core.scheduler
        plan = sched.begin_step()
        if sched.waiting or sched.prefilling:
            admission = sched.admit(plan, num_decodes)
        else:
            admission = Admission(DECODE_TURN)
        sched.end_step(plan, admission, decodes=True)
        if any(info.params.structured for info in plan.sampling):
            self.core.add_token_bitmasks(plan)  # as EngineCore.launch and execute
        return plan

    def _land_quiet(self, plan: BatchPlan, forward: float) -> None:
        """Execute and land a step whose plan holds nothing but its counted decodes, which end
        no request: what ``_execute`` and ``EngineCore.land`` do with such a plan (no token to
        append, no prefix to cache, no request to end; the policy still observes the step),
        without building the output and events that would carry nothing."""
        sched = self.core.scheduler
        swap = self.executor.swap_seconds(plan)
        seconds = forward + swap
        self.executor.clock.advance(seconds)
        sched.inflight = None
        sched._inflight_owners = {}
        sched.retraction.total_computed_tokens += plan.num_tokens + len(self.members)
        sched.retraction.swap_seconds += swap
        sched.policy.observe(plan, seconds)
        lifecycle = self.core.lifecycle
        if lifecycle._ended or lifecycle._released:
            self.core.events()  # the simulator reads records, not events

    def _execute(self, plan: BatchPlan, forward: float) -> StepOutput:
        """SimulatedExecutor.execute for the plan's extends, its decodes already costed."""
        executor = self.executor
        swap = executor.swap_seconds(plan)
        seconds = forward + swap
        executor.clock.advance(seconds)
        n = len(plan.sampling)
        return StepOutput(
            [self.token] * n,
            [None] * n,
            forward_seconds=seconds,
            swap_seconds=swap,
            pooled=[[0.0] for _ in plan.pooled_segments],
            prompt_logprobs=[
                [TokenLogprobs(0.0, []) for _ in seg.scoring.target_ids]
                for seg in plan.scoring_segments
                if seg.scoring is not None
            ],
        )


def _by_order(member: _Decoding) -> int:
    return member.order
