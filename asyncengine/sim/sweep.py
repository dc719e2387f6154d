"""Simulator runs as jobs: a grid of configurations (``--sweep``), run here or as Ray tasks.

A job is one engine configuration, optionally behind N replicas and a router (the simulator's
multi-replica mode). Runs are deterministic (virtual time), so a job gives the same records on
any machine: fanning a grid out over a Ray cluster changes how long it takes, not its results.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncengine.api.ray_local import init_ray
from asyncengine.bench.records import BenchSummary, RequestRecord
from asyncengine.common.config import EngineConfig
from asyncengine.common.plugin_spec import same_plugin
from asyncengine.routing import make_router
from asyncengine.sim.cost_model import CostModel
from asyncengine.workloads.trace import WorkloadRequest

# --sweep keys that are not EngineConfig fields
JOB_KEYS = ("replicas", "router")
# config keys naming a plug-in whose options ("<key>_options") belong to that plug-in alone
OPTIONED_KEYS = ("policy", "shadow_policy", "eviction_policy", "length_predictor")


@dataclass(frozen=True, slots=True)
class SimJob:
    label: str
    config: EngineConfig
    replicas: int = 1
    router: str | None = None  # with replicas: cache-aware when None
    router_options: dict[str, Any] = field(default_factory=dict)

    @property
    def multi_replica(self) -> bool:
        return self.replicas > 1 or self.router is not None


@dataclass(slots=True)
class SimJobResult:
    label: str
    records: list[RequestRecord]
    summary: BenchSummary
    # what the run did, the same on any machine (summary.json is committed with the docs and
    # must not change when the experiments are re-run elsewhere: no wall or CPU times here)
    details: dict[str, Any]


def parse_sweep(specs: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """``["chunked_prefill_size=256,512", "router=cache-aware,round-robin"]`` -> keys and values
    (a value is JSON when it parses, else a string; a JSON object or list is one value, commas
    and all: ``'policy_options={"aging":0.5,"max_wait_tokens":100},{"aging":1.0}'``)."""
    axes = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"expected KEY=V1,V2,..., got {spec!r}")
        axes.append((key.replace("-", "_"), _sweep_values(key, values)))
    return axes


def _sweep_values(key: str, text: str) -> list[Any]:
    """The comma-separated values of ``text``: JSON where a value parses, else its string."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    start = 0
    while True:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            end = -1
        if end < 0 or (end < len(text) and text[end] != ","):
            if text[start : start + 1] in ("{", "["):
                raise ValueError(f"--sweep {key}: {text[start:]!r} is not a JSON object or list")
            comma = text.find(",", start)
            end = len(text) if comma < 0 else comma
            value = text[start:end]
        values.append(value)
        if end == len(text):
            return values
        start = end + 1


def expand(base: Sequence[SimJob], sweep: Sequence[tuple[str, list[Any]]]) -> list[SimJob]:
    """Every base job at every point of the sweep grid (the cartesian product of its axes)."""
    if not sweep:
        return list(base)
    keys = [key for key, _ in sweep]
    jobs = []
    for job in base:
        for point in itertools.product(*(values for _, values in sweep)):
            changes = dict(zip(keys, point, strict=True))
            label = " ".join([job.label, *(f"{k}={v}" for k, v in changes.items())])
            replicas = int(changes.pop("replicas", job.replicas))
            router = changes.pop("router", job.router)
            changes.update(_options_left_behind(job.config, changes))
            config = job.config.replace(**changes) if changes else job.config
            jobs.append(SimJob(label, config, replicas, router, job.router_options))
    return jobs


def _options_left_behind(config: EngineConfig, changes: dict[str, Any]) -> dict[str, Any]:
    """Empty options for each plug-in a sweep point swaps for another: the config's options
    are its own plug-in's (an ``arc`` step given to ``lru`` would not build)."""
    dropped: dict[str, Any] = {}
    for key in OPTIONED_KEYS:
        value, own = changes.get(key), getattr(config, key)
        if f"{key}_options" in changes or not isinstance(value, str):
            continue
        if not (isinstance(own, str) and same_plugin(value, own)):
            dropped[f"{key}_options"] = {}
    return dropped


def run_job(job: SimJob, workload: Sequence[WorkloadRequest], cost: CostModel) -> SimJobResult:
    """One simulated run (a Ray task when fanned out)."""
    logging.getLogger("asyncengine.scheduler.scheduler").setLevel(
        logging.ERROR
    )  # retract notes: counted
    if not job.multi_replica:
        from asyncengine.sim.simulator import simulate

        result = simulate(job.config, workload, cost)
        details: dict[str, Any] = {
            "steps": result.steps,
            "virtual_seconds": result.virtual_seconds,
            "scheduler_stats": result.scheduler_stats,
            "pages_total": result.scheduler_stats["pages_total"],
            "admission_blocked": result.core_stats["admission_blocked"],
            "shadow": result.core_stats["shadow"],
            "length_predictor": result.core_stats["length_predictor"],
            "peak_waiting": result.peak_waiting,
        }
        return SimJobResult(job.label, result.records, result.summary, details)
    from asyncengine.sim.multi_replica import MultiReplicaSimulator

    router = make_router(job.router or "cache-aware", **job.router_options)
    multi = MultiReplicaSimulator(job.config, job.replicas, router, cost).run(workload)
    per_replica = [0] * job.replicas
    for decision in multi.decisions:
        per_replica[decision.replica] += 1
    details = {
        "replicas": job.replicas,
        "router": router.name,
        "router_decisions": multi.router_decisions,
        "requests_per_replica": per_replica,
        "steps": multi.steps,
        "virtual_seconds": multi.virtual_seconds,
        "replica_stats": multi.replica_stats,
    }
    return SimJobResult(job.label, multi.records, multi.summary, details)


def run_jobs(
    jobs: Sequence[SimJob],
    workload: Sequence[WorkloadRequest],
    cost: CostModel,
    ray_address: str | None = None,
) -> list[SimJobResult]:
    """Run ``jobs`` in order here, or as Ray tasks when ``ray_address`` is given ("local": a
    local instance started and stopped here; else a cluster's address, e.g. "auto")."""
    if ray_address is None:
        return [run_job(job, workload, cost) for job in jobs]
    import ray

    started = not ray.is_initialized()
    if started:
        init_ray(None if ray_address == "local" else ray_address)
    try:
        task = ray.remote(num_cpus=1)(run_job)
        workload_ref: Any = ray.put(list(workload))
        cost_ref: Any = ray.put(cost)
        results: list[SimJobResult] = ray.get(
            [task.remote(j, workload_ref, cost_ref) for j in jobs]
        )
        return results
    finally:
        if started:
            ray.shutdown()
