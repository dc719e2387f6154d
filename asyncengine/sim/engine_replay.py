"""Replay a workload against the real AsyncEngine on the wall clock, into RequestRecords."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncengine.bench.records import RequestRecord
from asyncengine.common.config import EngineConfig
from asyncengine.common.outputs import GenerateOutput
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.sim.step_log import StepLog
from asyncengine.sim.workload_replay import params_for
from asyncengine.workloads.trace import WorkloadRequest

if TYPE_CHECKING:
    from asyncengine.api.engine import AsyncEngine


async def replay_real(
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    warmup_requests: int = 1,
    step_log: StepLog | None = None,
    outputs: dict[str, list[int]] | None = None,
) -> tuple[list[RequestRecord], dict[str, object]]:
    """Run ``workload`` on an ``AsyncEngine(config)``; returns the records and engine stats.

    Times in the records are relative to the first arrival. Per-token times come from the
    engine's own metrics (TTFT, then the inter-token gaps), so they do not include the
    caller's scheduling jitter. ``step_log`` (if given) logs every step after the warm-up, on
    the same clock. ``outputs`` (if given) receives each request's generated token ids.
    """
    from asyncengine.api.engine import AsyncEngine

    async with AsyncEngine(config) as engine:
        await warm_up(engine, workload, warmup_requests)
        loop = asyncio.get_running_loop()
        start = loop.time()
        if step_log is not None:
            core = engine.core
            assert core is not None  # started by the context manager
            step_log.attach(core.scheduler, lambda: loop.time() - start)
            core.step_hooks.append(step_log)

        async def one(item: WorkloadRequest) -> list[RequestRecord]:
            """The records of ``item``'s choices (one per choice, as the simulator's)."""
            delay = start + item.arrival_time - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            arrival = loop.time() - start
            rids = item.choice_rids
            outs: list[GenerateOutput | None]
            try:
                given = await engine.generate_choices(
                    item.prompt_ids, params_for(item), request_id=item.rid
                )
                outs = list(given)
            except Exception:  # every failure counts as a failed request; the run goes on
                outs = [None] * len(rids)
            now = loop.time() - start
            records = []
            for rid, out in zip(rids, outs, strict=True):
                if outputs is not None and out is not None:
                    outputs[rid] = list(out.token_ids)
                records.append(record_of(item, arrival, out, now, rid))
            return records

        per_item = await asyncio.gather(*(one(item) for item in workload))
        return [record for records in per_item for record in records], dict(engine.stats())


async def warm_up(
    engine: AsyncEngine, workload: Sequence[WorkloadRequest], warmup_requests: int
) -> None:
    """Compile, allocate and warm caches on the workload's first prompts (and each adapter
    once: its first step builds its kernel tables), then forget them: they must not turn
    into hits."""
    for item in itertools.islice(workload, warmup_requests):
        await engine.generate(
            item.prompt_ids[:8], SamplingParams(max_new_tokens=2, ignore_eos=True)
        )
    adapters = sorted({item.lora for item in workload if item.lora is not None})
    if warmup_requests and adapters:
        prompt = workload[0].prompt_ids[:8]
        await asyncio.gather(
            *(
                engine.generate(
                    prompt, SamplingParams(max_new_tokens=2, ignore_eos=True, lora=name)
                )
                for name in adapters
            )
        )
    await engine.reset_prefix_cache(reset_counters=True)


def record_of(
    item: WorkloadRequest,
    arrival: float,
    out: GenerateOutput | None,
    now: float,
    rid: str | None = None,
) -> RequestRecord:
    """The record of ``item`` (or of its choice ``rid``) sent at ``arrival`` (run time);
    ``out`` None: it raised."""
    record = RequestRecord(rid or item.rid, arrival, len(item.prompt_ids))
    record.tenant, record.priority, record.lora = item.tenant, item.priority, item.lora
    if out is None:  # every failure counts as a failed request; the run goes on
        record.failed = True
        record.finish_time = now
        return record
    metrics = out.metrics
    record.blocked = dict(metrics.blocked)
    record.queue_time = metrics.queue_time
    record.timed_out = out.finish_reason == "timeout"
    record.finish_time = arrival + metrics.e2e
    if not out.token_ids:
        return record
    ttft = metrics.ttft if metrics.ttft is not None else metrics.e2e
    times = [arrival + ttft]
    for gap in metrics.itl:
        times.append(times[-1] + gap)
    record.token_times = times
    record.cached_tokens = out.usage.cached_tokens
    record.retracts = getattr(metrics, "retractions", 0)
    record.failed = out.finish_reason == "abort"
    return record
