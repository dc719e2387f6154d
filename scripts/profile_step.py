#!/usr/bin/env python
"""Where an engine step's time goes: one offline run of the real AsyncEngine, instrumented.

Every part of a step is timed where it runs (wall time, summed over the run):

- on the event-loop thread: scheduling and plan building (``core.schedule``), commit
  (``core.commit``), detokenisation and streaming (the engine's ``_emit``), and the rest of the
  loop (waiting on the forward, callers' coroutines, asyncio);
- on the forward thread: plan -> tensors (``runner.prepare``), the model forward and LM head
  (``runner._logits``), sampling (``sampler.sample``).

Then the same plans are replayed alone, on a fresh executor in this thread with nothing else
running (page writes and shapes identical, so the work is the same): the difference between the
forward thread's time in the engine and alone is what the loop thread's concurrent work costs
the forward (the GIL and the two cores it shares). ``--forward-profile`` also runs
``torch.profiler`` over the replay and groups the forward's ops (GEMMs, attention, K/V gathers
and stores, norms/rotary/activations, the rest).

    python scripts/profile_step.py --num-requests 128 --out bench_results/profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncengine.config import EngineConfig, key_value
from asyncengine.plan import BatchPlan
from asyncengine.sampling_params import SamplingParams
from asyncengine.workloads import make_workload

# torch.profiler op names -> the part of the forward they belong to
OP_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("GEMMs (incl. LM head)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "mkldnn")),
    ("attention kernels", ("scaled_dot_product", "attention", "sampled_addmm", "embedding_bag")),
    ("K/V gather and store", ("index_select", "index_copy", "index_put", "gather", "scatter")),
    ("norms, rotary, activations", ("aten::mul", "aten::add", "aten::silu", "aten::pow",
                                    "aten::mean", "aten::rsqrt", "aten::neg", "aten::sub",
                                    "aten::div", "aten::cat", "aten::sum")),
]  # fmt: skip


class Timer:
    """Accumulates the wall time of calls to wrapped functions, by part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        return timed


def instrument(engine: Any, timer: Timer) -> list[BatchPlan]:
    core = engine.core
    runner = core.executor.runner
    plans: list[BatchPlan] = []
    schedule = core.schedule

    def recording_schedule() -> BatchPlan | None:
        plan = schedule()
        if plan is not None:
            plans.append(plan)
        return plan

    core.schedule = timer.wrap("loop: schedule + plan", recording_schedule)
    core.commit = timer.wrap("loop: commit", core.commit)
    engine._emit = timer.wrap("loop: detokenize + stream", engine._emit)
    runner.prepare = timer.wrap("forward thread: plan -> tensors", runner.prepare)
    runner._logits = timer.wrap("forward thread: model + LM head", runner._logits)
    runner.sampler.sample = timer.wrap("forward thread: sampling", runner.sampler.sample)
    core.executor.execute = timer.wrap("forward thread: execute (all)", core.executor.execute)
    return plans


async def engine_run(config: EngineConfig, workload: list, timer: Timer) -> tuple[float, list]:
    from asyncengine.engine import AsyncEngine

    async with AsyncEngine(config) as engine:
        warm = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        await engine.generate(list(range(3, 19)), warm)
        plans = instrument(engine, timer)
        start = time.perf_counter()
        await asyncio.gather(
            *(
                engine.generate(
                    w.prompt_ids,
                    SamplingParams(max_new_tokens=w.output_len, temperature=0.0, ignore_eos=True),
                )
                for w in workload
            )
        )
        return time.perf_counter() - start, plans


def replay_alone(config: EngineConfig, plans: list[BatchPlan], profile: bool) -> dict[str, Any]:
    """The engine's plans again on a fresh executor, alone in this thread."""
    from asyncengine.builder import build_core
    from asyncengine.executor.model_executor import ModelExecutor

    executor = ModelExecutor(config)
    build_core(config, executor)  # binds the executor to the same layout
    timer = Timer()
    runner = executor.runner
    assert runner is not None
    runner.prepare = timer.wrap("plan -> tensors", runner.prepare)
    runner._logits = timer.wrap("model + LM head", runner._logits)
    runner.sampler.sample = timer.wrap("sampling", runner.sampler.sample)
    execute = timer.wrap("execute (all)", executor.execute)
    for plan in plans:
        execute(plan)
    groups: dict[str, float] = {}
    if profile:  # the same plans again under the profiler (its own overhead stays out above)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for plan in plans:
                executor.execute(plan)
        groups = group_ops(prof)
    return {"seconds": dict(timer.seconds), "op_groups_seconds": groups}


def group_ops(prof: Any) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        name = event.key
        seconds = event.self_cpu_time_total / 1e6
        for group, needles in OP_GROUPS:
            if any(n in name for n in needles):
                totals[group] += seconds
                break
        else:
            totals["other ops (copies, views, allocation, dispatch)"] += seconds
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workload-arg", action="append", type=key_value, default=[], metavar="KEY=VALUE"
    )
    parser.add_argument(
        "--engine-arg", action="append", type=key_value, default=[], metavar="KEY=VALUE"
    )
    parser.add_argument("--forward-profile", action="store_true", help="torch.profiler op groups")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    config = EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", log_interval=0.0, **dict(args.engine_arg)
    )
    workload_args = {"input_median": 160, "output_median": 96, **dict(args.workload_arg)}
    workload = make_workload(
        "random", num_requests=args.num_requests, seed=args.seed, vocab_size=49152, **workload_args
    )
    timer = Timer()
    wall, plans = asyncio.run(engine_run(config, workload, timer))
    tokens = sum(w.output_len for w in workload)
    alone = replay_alone(config, plans, args.forward_profile)
    in_engine = timer.seconds
    loop_parts = {k: v for k, v in in_engine.items() if k.startswith("loop:")}
    loop_busy = sum(loop_parts.values())
    forward_all = in_engine["forward thread: execute (all)"]
    result = {
        "machine": {
            "torch_threads": torch.get_num_threads(),
            "load": list(__import__("os").getloadavg()),
        },
        "workload": {"requests": len(workload), "output_tokens": tokens, **workload_args},
        "steps": len(plans),
        "wall_seconds": wall,
        "output_tokens_per_second": tokens / wall,
        "in_engine_seconds": dict(in_engine),
        "loop_thread_other_seconds": max(0.0, wall - loop_busy - forward_all),
        "alone_seconds": alone["seconds"],
        "forward_slowdown_in_engine": forward_all / alone["seconds"]["execute (all)"],
        "forward_op_groups_seconds": alone["op_groups_seconds"],
    }
    print(f"{len(workload)} requests, {tokens} output tokens, {len(plans)} steps, {wall:.1f} s "
          f"wall ({tokens / wall:.1f} tok/s), torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'part':<40}{'seconds':>10}{'share of wall':>15}")
    for part, seconds in sorted(in_engine.items()):
        print(f"{part:<40}{seconds:>10.2f}{seconds / wall:>14.1%}")
    other = result["loop_thread_other_seconds"]
    print(f"{'loop: other (asyncio, callers, idle)':<40}{other:>10.2f}{other / wall:>14.1%}")
    print("\nthe same plans alone (this thread, nothing else running):")
    for part, seconds in alone["seconds"].items():
        print(f"  {part:<38}{seconds:>10.2f}")
    print(f"forward thread in the engine / alone: {result['forward_slowdown_in_engine']:.2f}x")
    if alone["op_groups_seconds"]:
        print("\nforward ops (torch.profiler self CPU time over the replay):")
        total = sum(alone["op_groups_seconds"].values())
        for group, seconds in alone["op_groups_seconds"].items():
            print(f"  {group:<48}{seconds:>8.2f} s {seconds / total:>6.1%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
