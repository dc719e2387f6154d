"""Simulator: the engine's real Scheduler, policies and radix tree on a virtual clock.

A simulated executor stands in for the model: every sampled segment gets a fixed non-EOS
token, and each step advances the clock by the cost model's estimate of that plan's forward
time. Requests arrive at their workload arrival times; the run reports the same per-request
records (and summary) a real run does.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asyncengine.bench.metrics import BenchSummary, RequestRecord, summarize
from asyncengine.cache.manager import KVCacheManager
from asyncengine.config import EngineConfig
from asyncengine.plan import BatchPlan, StepOutput
from asyncengine.request import Request
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler
from asyncengine.sim.cost_model import CostModel
from asyncengine.worker import DEFAULT_KV_TOKENS
from asyncengine.workloads.trace import WorkloadRequest
from policies.registry import make_policy

# bytes of K+V per token of the embedded default model (SmolLM2-135M: 30 layers x 3 kv heads
# x 64 dims x 2 tensors x 2 bytes bf16), to turn kv_cache_bytes into tokens
DEFAULT_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2
DEFAULT_MAX_MODEL_LEN = 8192  # the default model's max_position_embeddings

_start_pos = operator.attrgetter("start_pos")


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    summary: BenchSummary
    steps: int
    virtual_seconds: float
    wall_seconds: float
    cpu_seconds: (
        float  # this process's CPU time: the cost that other load on the machine cannot inflate
    )
    scheduler_stats: dict[str, float]


class VirtualClock:
    """Seconds since the run started, advanced only by the simulator."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the clock cannot go back ({seconds} s)")
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


def kv_pages_for(config: EngineConfig, bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN) -> int:
    """The KV pool size the engine would build from ``config`` (asyncengine.worker's rule)."""
    if config.kv_cache_bytes is not None:
        return max(1, config.kv_cache_bytes // (bytes_per_token * config.page_size))
    return -(-(config.kv_cache_tokens or DEFAULT_KV_TOKENS) // config.page_size)


class Simulator:
    """One simulated engine. ``run`` may be called once per instance."""

    def __init__(
        self,
        config: EngineConfig,
        cost_model: CostModel | None = None,
        *,
        max_model_len: int | None = None,
        eos_token_ids: Sequence[int] = (0,),
        sampled_token_id: int = 1,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
        check_invariant_every: int = 0,
    ) -> None:
        if sampled_token_id in eos_token_ids:
            raise ValueError("the simulated token must not be an EOS token")
        self.config = config
        self.cost_model = cost_model or CostModel.default()
        self.max_model_len = max_model_len or config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.sampled_token_id = sampled_token_id
        self.check_invariant_every = check_invariant_every
        self.clock = VirtualClock()
        page_size = config.page_size
        self.kv = KVCacheManager(
            num_pages=kv_pages_for(config, kv_bytes_per_token),
            page_size=page_size,
            max_requests=config.max_running_requests,
            max_pages_per_request=math.ceil(self.max_model_len / page_size),
            enable_prefix_cache=config.enable_prefix_cache,
        )
        self.policy = make_policy(config.policy, config.policy_options)
        self.scheduler = Scheduler(
            config, self.kv, self.policy, list(eos_token_ids), self.max_model_len, clock=self.clock
        )
        self._used = False

    def step_seconds(self, plan: BatchPlan) -> float:
        prefill_tokens = prefill_attention = 0
        for seg in plan.extends:
            n = len(seg.input_ids)
            prefill_tokens += n
            prefill_attention += n * seg.start_pos + n * (n + 1) // 2
        decodes = plan.decodes
        # a decode attends to its start_pos + 1 keys
        decode_context = sum(map(_start_pos, decodes)) + len(decodes)
        return self.cost_model.seconds(
            prefill_tokens, prefill_attention, len(decodes), decode_context
        )

    def run(self, workload: Sequence[WorkloadRequest]) -> SimResult:
        if self._used:
            raise RuntimeError("a Simulator runs one workload; make a new one")
        self._used = True
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        sched, clock = self.scheduler, self.clock
        pending = sorted(workload, key=lambda w: w.arrival_time)
        records: dict[str, RequestRecord] = {}
        requests: dict[str, Request] = {}
        next_arrival = 0
        steps = 0
        while next_arrival < len(pending) or sched.has_work():
            while next_arrival < len(pending) and pending[next_arrival].arrival_time <= clock.now:
                self._arrive(pending[next_arrival], requests, records)
                next_arrival += 1
            plan = sched.schedule() if sched.has_work() else None
            if plan is None:
                if next_arrival == len(pending):
                    if sched.has_work():
                        raise RuntimeError(
                            f"scheduler is stuck at t={clock.now:.3f}s: {sched.stats()}"
                        )
                    break
                clock.advance_to(pending[next_arrival].arrival_time)
                continue
            seconds = self.step_seconds(plan)
            clock.advance(seconds)
            n = len(plan.sampling)
            output = StepOutput([self.sampled_token_id] * n, [None] * n, forward_seconds=seconds)
            for event in sched.commit(plan, output):
                if event.finished:
                    self._finish(event.req, records)
            steps += 1
            if self.check_invariant_every and steps % self.check_invariant_every == 0:
                self.kv.check_invariant()
        ordered = [records[w.rid] for w in workload]
        stats = sched.stats()
        return SimResult(
            records=ordered,
            summary=summarize(ordered, retracts=int(stats["retractions"])),
            steps=steps,
            virtual_seconds=clock.now,
            wall_seconds=time.perf_counter() - wall_start,
            cpu_seconds=time.process_time() - cpu_start,
            scheduler_stats=stats,
        )

    def _arrive(
        self, item: WorkloadRequest, requests: dict[str, Request], records: dict[str, RequestRecord]
    ) -> None:
        record = RequestRecord(item.rid, item.arrival_time, len(item.prompt_ids))
        records[item.rid] = record
        if not item.prompt_ids or len(item.prompt_ids) >= self.max_model_len:
            record.failed = True  # the engine refuses it before queueing (no room to generate)
            record.finish_time = item.arrival_time
            return
        params = SamplingParams(max_new_tokens=item.output_len, ignore_eos=True, temperature=0.0)
        req = Request(item.rid, list(item.prompt_ids), params, item.arrival_time)
        requests[item.rid] = req
        self.scheduler.add_request(req)

    @staticmethod
    def _finish(req: Request, records: dict[str, RequestRecord]) -> None:
        record = records[req.rid]
        record.token_times = req.token_times
        record.finish_time = req.finished_time
        record.cached_tokens = req.cached_tokens
        record.retracts = req.retractions
        record.failed = req.finish_reason == "abort"


def simulate(
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    cost_model: CostModel | None = None,
    **options: object,
) -> SimResult:
    """Run ``workload`` through a fresh simulated engine built from ``config``."""
    return Simulator(config, cost_model, **options).run(workload)  # type: ignore[arg-type]
