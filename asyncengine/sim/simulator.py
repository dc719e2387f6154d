"""Simulator: the engine's real core (scheduler, policies, radix tree) on a virtual clock.

A SimulatedExecutor stands in for the model; a WorkloadReplay feeds the workload at its arrival
times. The run reports the same per-request records (and summary) a real run does.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from asyncengine.bench.records import BenchSummary, RequestRecord, summarize
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from asyncengine.policies.length_predictor import OraclePredictor
from asyncengine.sim.bulk_decode import BulkDecode
from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.lora_cost import LoraCharges, SimLoras
from asyncengine.sim.simulated_executor import (
    DEFAULT_SPEC,
    DEFAULT_SWAP_BYTES_PER_SECOND,
    SAMPLED_TOKEN_ID,
    SimulatedExecutor,
    default_kv_bytes_per_token,
)
from asyncengine.sim.workload_replay import WorkloadReplay
from asyncengine.workloads.compact import CompactWorkload
from asyncengine.workloads.trace import WorkloadRequest


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    summary: BenchSummary
    steps: int
    virtual_seconds: float
    wall_seconds: float
    # this process's CPU time: the cost that other load on the machine cannot inflate
    cpu_seconds: float
    scheduler_stats: dict[str, float]
    core_stats: dict[str, Any]  # engine.stats() of the run: admission blocks, shadow, tenants
    peak_waiting: int = 0  # the most requests the waiting queue held before a step


class Simulator:
    """One simulated engine. ``run`` may be called once per instance."""

    def __init__(
        self,
        config: EngineConfig,
        cost_model: CostModel | None = None,
        *,
        max_model_len: int | None = None,
        eos_token_ids: Sequence[int] = (0,),
        sampled_token_id: int = SAMPLED_TOKEN_ID,
        kv_bytes_per_token: int | None = None,
        check_invariant_every: int = 0,
        swap_bytes_per_second: float = DEFAULT_SWAP_BYTES_PER_SECOND,
        bulk_decode: bool = True,
        loras: SimLoras | None = None,
    ) -> None:
        """``bulk_decode``: count the decodes of the steps that allow it instead of writing
        them request by request (sim/bulk_decode.py): the same results, several times faster;
        False runs every step step by step. ``loras``: the adapters' ranks, how many stay
        loaded and their cost model (sim/lora_cost.py); a workload whose requests name
        adapters gets ``SimLoras.for_config(config.max_cpu_loras)`` when None.
        ``kv_bytes_per_token``: None takes the default model's in the config's
        ``kv_cache_dtype`` (int8: ~1.94x the tokens of bfloat16 in ``kv_cache_bytes``)."""
        speculation = config.speculation
        if speculation is not None and speculation.method == "draft":
            raise ConfigError(
                "config key 'speculative': the simulator has no cost model for a draft model"
            )
        spec = replace(
            DEFAULT_SPEC,
            max_model_len=max_model_len or config.max_model_len or DEFAULT_SPEC.max_model_len,
            eos_token_ids=tuple(eos_token_ids),
            kv_bytes_per_token=kv_bytes_per_token
            or default_kv_bytes_per_token(config.kv_cache_dtype),
        )
        self.config = config
        self.clock = VirtualClock()
        self.executor = SimulatedExecutor(
            cost_model or CostModel.default(),
            self.clock,
            spec,
            sampled_token_id,
            swap_bytes_per_second,
        )
        self.core = build_core(config, self.executor, clock=self.clock)
        # the simulated executor reads no page ids: the manager's table keeps its rows only
        self.core.kv.page_table.rows_only()
        self.check_invariant_every = check_invariant_every
        self.bulk = BulkDecode(self.core) if bulk_decode else None
        if loras is not None:
            loras.check_fits(config.max_loras)
        self.loras = loras
        self._used = False

    def run(self, workload: Sequence[WorkloadRequest]) -> SimResult:
        if self._used:
            raise RuntimeError("a Simulator runs one workload; make a new one")
        self._used = True
        reveal_lengths(self.core, workload)
        if not isinstance(workload, CompactWorkload):  # which holds no acceptance
            self.executor.acceptance = {
                rid: item.acceptance
                for item in workload
                if item.acceptance is not None
                for rid in item.choice_rids
            }
            adapters = {
                rid: item.lora
                for item in workload
                if item.lora is not None
                for rid in item.choice_rids
            }
            if adapters:
                loras = self.loras
                if loras is None:
                    loras = SimLoras.for_config(self.config.max_cpu_loras)
                in_flight = self.core.scheduler.requests
                self.executor.lora = LoraCharges(
                    loras, adapters, in_flight, loaded=tuple(self.config.loras)
                )
                # bulk decoding costs decodes without their requests: LoRA rows need them
                self.bulk = None
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        replay = WorkloadReplay(
            self.core,
            self.clock,
            workload,
            check_invariant_every=self.check_invariant_every,
            bulk=self.bulk,
            keep_requests=False,  # a run gives records: a million requests fit in memory
            lora=self.executor.lora,
        )
        with fewer_collections():
            records = replay.run()
        stats = self.core.scheduler.stats()
        if self.executor.lora is not None:
            stats.update(self.executor.lora.stats())
        return SimResult(
            records=records,
            summary=summarize(records, retracts=int(stats["retractions"])),
            steps=replay.steps,
            virtual_seconds=self.clock.now,
            wall_seconds=time.perf_counter() - wall_start,
            cpu_seconds=time.process_time() - cpu_start,
            scheduler_stats=stats,
            core_stats=self.core.stats(),
            peak_waiting=replay.peak_waiting,
        )


# Python's young-generation threshold (700 allocations) makes a run that keeps hundreds of
# thousands of requests collect every few hundred objects it makes, finding almost nothing to
# free: 8% of a 100k-request run's CPU time; at this threshold, 2%
_RUN_GC_THRESHOLD = (50_000, 20, 50)


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the block with the cyclic garbage collector's thresholds raised (restored after)."""
    before = gc.get_threshold()
    gc.set_threshold(*_RUN_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def reveal_lengths(core: EngineCore, workload: Sequence[WorkloadRequest]) -> None:
    """Give an ``oracle`` length predictor the trace's output lengths (only a simulator can)."""
    predictor = core.scheduler.lengths.predictor
    if isinstance(predictor, OraclePredictor):
        if isinstance(workload, CompactWorkload):  # without making each request
            predictor.reveal(dict(zip(workload.rids, workload.output_lens.tolist(), strict=True)))
        else:
            predictor.reveal(
                {rid: item.output_len for item in workload for rid in item.choice_rids}
            )


def simulate(
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    cost_model: CostModel | None = None,
    **options: object,
) -> SimResult:
    """Run ``workload`` through a fresh simulated engine built from ``config``."""
    return Simulator(config, cost_model, **options).run(workload)  # type: ignore[arg-type]
