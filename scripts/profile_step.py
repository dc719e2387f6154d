#!/usr/bin/env python
"""Where an engine step's time goes: one offline run of the real AsyncEngine, instrumented.

Every part of a step is timed where it runs (wall time, summed over the run):

- on the event-loop thread: scheduling and plan building (``core.launch``), landing the step
  (``core.land``: commit, every request's stop checks, detokenisation and stop strings),
  streaming (``engine.streams.publish``), and the rest of the loop (waiting on the forward,
  callers' coroutines, asyncio);
- on the forward thread: plan -> tensors (``runner.prepare``), the model forward and LM head
  (``runner._forward``), sampling (``sampler.sample``).

Then the same plans are replayed alone, on a fresh executor in this thread with nothing else
running (page writes and shapes identical, so the work is the same): the difference between the
forward thread's time in the engine and alone is what the loop thread's concurrent work costs
the forward (the GIL and the two cores it shares). The replay also splits the forward into
its parts, timed where they are called: the projections (GEMMs; with the SwiGLU a quantized down
projection makes inside its int8 product), the LM head, attention (with the K/V store), norms,
rotary, the MLP activation, a small decode step's layers fused in one native call, and the rest
(embedding, Python, plan). Both runs start with the int8 panels built (start-up's deferred work)
and the built objects frozen out of the collector's passes, as the engine does.

Native kernels and weight prepacking can be switched off (``ASYNCENGINE_NATIVE_KERNELS=0
ASYNCENGINE_PACKED_LINEAR=0``) to profile the torch paths the same way.

    python scripts/profile_step.py --num-requests 128 --out bench_results/profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncengine.common.config import EngineConfig, key_value
from asyncengine.common.plan import BatchPlan
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.script_main import run_main
from asyncengine.workloads import make_workload


class Timer:
    """Accumulates the wall time of calls to wrapped functions, by part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._open: dict[str, int] = collections.defaultdict(int)  # calls of a part under way

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._open[part]:  # a call inside a timed call of the same part: counted once
                return fn(*args, **kwargs)
            self._open[part] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._open[part] -= 1
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        return timed


def instrument(engine: Any, timer: Timer) -> list[BatchPlan]:
    core = engine.core
    runner = core.executor.runner
    plans: list[BatchPlan] = []
    launch = core.launch

    def recording_launch() -> BatchPlan | None:
        plan = launch()
        if plan is not None:
            plans.append(plan)
        return plan

    core.launch = timer.wrap("loop: launch (schedule + plan)", recording_launch)
    core.land = timer.wrap("loop: land (commit, stops, detokenize)", core.land)
    engine.streams.publish = timer.wrap("loop: stream", engine.streams.publish)
    runner.prepare = timer.wrap("forward thread: plan -> tensors", runner.prepare)
    runner._forward = timer.wrap("forward thread: model + LM head", runner._forward)
    runner.sampler.sample = timer.wrap("forward thread: sampling", runner.sampler.sample)
    core.executor.execute = timer.wrap("forward thread: execute (all)", core.executor.execute)
    return plans


async def engine_run(config: EngineConfig, workload: list, timer: Timer) -> tuple[float, list]:
    from asyncengine.api.engine import AsyncEngine

    async with AsyncEngine(config) as engine:
        warm = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        await engine.generate(list(range(3, 19)), warm)
        await engine.one_time_work_done()  # start-up's deferred work (int8 panels): not timed
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


def replay_alone(config: EngineConfig, plans: list[BatchPlan]) -> dict[str, Any]:
    """The engine's plans again on a fresh executor, alone in this thread, with the forward's
    parts timed."""
    from asyncengine.core.builder import build_core
    from asyncengine.executor.layers.linear import Linear, QuantizedLinear
    from asyncengine.executor.model_executor import ModelExecutor

    executor = ModelExecutor(config)
    build_core(config, executor)  # binds the executor to the same layout
    one_time_work = executor.defer_one_time_work()  # the int8 panels, built before as in the run
    while one_time_work is not None and one_time_work():
        pass
    gc.collect()  # the built executor frozen out of the collector's passes, as the engine does
    gc.freeze()
    timer = Timer()
    runner = executor.runner
    assert runner is not None
    runner.prepare = timer.wrap("plan -> tensors", runner.prepare)
    runner._forward = timer.wrap("model + LM head", runner._forward)
    runner.sampler.sample = timer.wrap("sampling", runner.sampler.sample)
    parts = Timer()
    model = runner.model
    lm_head = model.lm_head
    time_products(lm_head, parts, "LM head")
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            time_products(getattr(layer, name), parts, "projections (GEMMs)")
    # a small decode step's layers are one native call (native_decode.takes)
    if model.native_decode is not None:
        model.native_decode.step = parts.wrap(
            "fused decode steps' layers (one native call)", model.native_decode.step
        )
    backend = runner.backend
    ops = model.ops
    # the model calls attend() when the native kernels stored K/V, forward() (store + attend)
    # otherwise: time the one it calls, not both
    if ops.rotary_store is not None:
        backend.attend = parts.wrap("attention", backend.attend)  # type: ignore[method-assign]
    else:
        backend.forward = parts.wrap("attention (incl. K/V store)", backend.forward)  # type: ignore[method-assign]
    wrapped = {
        "rms_norm": parts.wrap("norms (+ residual add)", ops.rms_norm),
        "fused_add_rms_norm": parts.wrap("norms (+ residual add)", ops.fused_add_rms_norm),
        "silu_and_mul": parts.wrap("MLP activation", ops.silu_and_mul),
        "apply_rotary": parts.wrap("rotary", ops.apply_rotary),
    }
    if ops.rotary_store is not None:
        wrapped["rotary_store"] = parts.wrap("rotary + K/V store", ops.rotary_store)
    model.ops = dataclasses.replace(ops, **wrapped)
    model.act_and_mul = parts.wrap("MLP activation", model.act_and_mul)
    execute = timer.wrap("execute (all)", executor.execute)
    by_kind = Timer()  # prefill-only, mixed (extends + decodes) and decode-only steps
    for plan in plans:
        kind = step_kind(plan)
        by_kind.wrap(kind, execute)(plan)
        by_kind.seconds[kind + " tokens"] += sum(len(s.input_ids) for s in plan.extends) + len(
            plan.decodes
        )
    assert isinstance(lm_head, (Linear, QuantizedLinear))
    forward = timer.seconds["model + LM head"]
    breakdown = dict(parts.seconds)
    breakdown["the rest (embedding, Python, dispatch)"] = max(
        0.0, forward - sum(parts.seconds.values())
    )
    return {
        "seconds": dict(timer.seconds),
        "forward_parts_seconds": breakdown,
        "steps_by_kind": {
            kind: {
                "steps": by_kind.calls[kind],
                "seconds": by_kind.seconds[kind],
                "tokens": int(by_kind.seconds[kind + " tokens"]),
            }
            for kind in ("prefill", "mixed", "decode")
            if by_kind.calls[kind]
        },
    }


def step_kind(plan: BatchPlan) -> str:
    if not plan.extends:
        return "decode"
    return "mixed" if plan.decodes else "prefill"


def time_products(linear: Any, timer: Timer, part: str) -> None:
    """Time every product ``linear`` runs under ``part``, its class kept (a timed subclass of
    it), so the model still takes the paths it picks by class: a quantized down projection's
    SwiGLU made inside its int8 product (timed here, not as the MLP activation), the LM head's
    float32 logits."""
    cls = type(linear)
    methods = [m for m in ("__call__", "float32_out", "silu_and_mul_product") if hasattr(cls, m)]
    timed = {m: timer.wrap(part, getattr(cls, m)) for m in methods}
    linear.__class__ = type(f"Timed{cls.__name__}", (cls,), {"__slots__": (), **timed})


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
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--no-replay",
        action="store_true",
        help="only the engine run (on CUDA the forward thread's parts time kernel launches, "
        "and the sampler's wait for the GPU)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        log_interval=0.0,
        **dict(args.engine_arg),
    )
    workload_args = {"input_median": 160, "output_median": 96, **dict(args.workload_arg)}
    workload = make_workload(
        "random", num_requests=args.num_requests, seed=args.seed, vocab_size=49152, **workload_args
    )
    timer = Timer()
    wall, plans = asyncio.run(engine_run(config, workload, timer))
    tokens = sum(w.output_len for w in workload)
    alone = None if args.no_replay else replay_alone(config, plans)
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
    }
    if alone is not None:
        result["alone_seconds"] = alone["seconds"]
        result["forward_slowdown_in_engine"] = forward_all / alone["seconds"]["execute (all)"]
        result["forward_parts_seconds"] = alone["forward_parts_seconds"]
    print(f"{len(workload)} requests, {tokens} output tokens, {len(plans)} steps, {wall:.1f} s "
          f"wall ({tokens / wall:.1f} tok/s), torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'part':<40}{'seconds':>10}{'share of wall':>15}")
    for part, seconds in sorted(in_engine.items()):
        print(f"{part:<40}{seconds:>10.2f}{seconds / wall:>14.1%}")
    other = result["loop_thread_other_seconds"]
    print(f"{'loop: other (asyncio, callers, idle)':<40}{other:>10.2f}{other / wall:>14.1%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if alone is None:
        return result
    print("\nthe same plans alone (this thread, nothing else running):")
    for part, seconds in alone["seconds"].items():
        print(f"  {part:<38}{seconds:>10.2f}")
    print(f"forward thread in the engine / alone: {result['forward_slowdown_in_engine']:.2f}x")
    print("\nthe replay's steps by kind (extends only, extends + decodes, decodes only):")
    for kind, row in alone["steps_by_kind"].items():
        print(
            f"  {kind:<10}{row['steps']:>6} steps{row['tokens']:>8} tokens{row['seconds']:>9.2f} s"
        )
    result["steps_by_kind"] = alone["steps_by_kind"]
    print("\nthe forward of the replay, by part:")
    total = sum(alone["forward_parts_seconds"].values())
    for part, seconds in sorted(alone["forward_parts_seconds"].items(), key=lambda kv: -kv[1]):
        print(f"  {part:<48}{seconds:>8.2f} s {seconds / total:>6.1%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    run_main(main)
