#!/usr/bin/env python
"""Measure the real ModelRunner over a grid of batch plans and fit the simulator's cost model.

    python scripts/fit_cost_model.py --out asyncengine/sim/default_cost_model.json
    python scripts/fit_cost_model.py --device cuda --backend triton --out cost_h100.json

Every plan is built on a real KV cache manager (page tables filled, positions past the cached
prefix), run once to warm up and then ``--repeats`` times; the median forward+sample time is
the sample. The fit is the cost model's non-negative least squares on relative error; the
script prints measured vs predicted per plan and the error quantiles.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from asyncengine.cache.manager import KVCacheManager, SeqKV
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import build_core
from asyncengine.core.executor_api import Executor
from asyncengine.executor.model_executor import ModelExecutor
from asyncengine.script_main import run_main
from asyncengine.sim.cost_model import CostModel, StepFeatures


@dataclass(frozen=True, slots=True)
class PlanShape:
    """Extends as (cached prefix, new tokens) pairs; decodes as KV lengths (incl. the new token)."""

    extends: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(p + n for p, n in self.extends) + sum(self.decodes)


def grid(quick: bool) -> list[PlanShape]:
    chunks = (16, 128, 512) if quick else (16, 64, 256, 512, 1024, 2048)
    prefixes = (0, 1024) if quick else (0, 512, 2048)
    batches = (1, 8, 32) if quick else (1, 4, 16, 32, 64, 128)
    contexts = (64, 1024) if quick else (64, 512, 2048)
    shapes = [PlanShape(extends=((p, n),)) for n in chunks for p in prefixes]
    shapes += [PlanShape(extends=((0, 128),) * 4), PlanShape(extends=((512, 64),) * 8)]
    shapes += [PlanShape(decodes=(c,) * b) for b in batches for c in contexts]
    shapes += [
        PlanShape(extends=((p, n),), decodes=(c,) * b)
        for n, p in ((256, 0), (512, 1024))
        for b, c in ((8, 512), (32, 256))
    ]
    return shapes


class PlanBench:
    def __init__(
        self,
        executor: Executor,
        kv: KVCacheManager,
        vocab_size: int,
        seed: int,
        cpu_clock: bool = False,
    ) -> None:
        self.clock = time.process_time if cpu_clock else time.perf_counter
        self.executor = executor
        self.kv = kv
        self.vocab = vocab_size
        self.rng = np.random.default_rng(seed)
        self.params = SamplingParams(max_new_tokens=16, temperature=0.0)

    def build(self, shape: PlanShape) -> tuple[BatchPlan, list[SeqKV]]:
        plan = BatchPlan(step=0)
        seqs: list[SeqKV] = []
        for i, (prefix, new) in enumerate(shape.extends):
            seq, ids = self._seq(prefix + new)
            plan.extends.append(Segment(f"e{i}", seq.row, ids[prefix:], prefix, sample=True))
            plan.sampling.append(SamplingInfo(self.params, ids, []))
            seqs.append(seq)
        for i, context in enumerate(shape.decodes):
            seq, ids = self._seq(context)
            plan.decodes.append(Segment(f"d{i}", seq.row, ids[-1:], context - 1, sample=True))
            plan.sampling.append(SamplingInfo(self.params, ids, []))
            seqs.append(seq)
        plan.page_writes = self.kv.page_table.drain_writes()
        return plan, seqs

    def _seq(self, length: int) -> tuple[SeqKV, list[int]]:
        ids = self.rng.integers(0, self.vocab, size=length).tolist()
        seq = self.kv.open(ids)  # the prefix cache is off: nothing is matched
        self.kv.extend(seq, length)
        return seq, ids

    def time(self, shape: PlanShape, repeats: int) -> float:
        plan, seqs = self.build(shape)
        try:
            self.executor.execute(plan)  # warm-up (compilation, allocator)
            samples = []
            for _ in range(repeats):
                start = self.clock()
                self.executor.execute(plan)  # returns Python ints: the device has synchronized
                samples.append(self.clock() - start)
            return statistics.median(samples)
        finally:
            for seq in seqs:
                self.kv.close(seq, cache=False)


def main(argv: Sequence[str] | None = None) -> CostModel:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a smaller grid (a few minutes on CPU)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: torch default)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time, robust to other load on a shared machine "
        "(needs --device cpu --threads 1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="cost model JSON to write")
    parser.add_argument("--samples-out", default=None, help="also save the raw measurements (JSON)")
    args = parser.parse_args(argv)

    if args.clock == "cpu" and (args.device != "cpu" or args.threads != 1):
        parser.error("--clock cpu measures one thread's work: use it with --device cpu --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = grid(args.quick)
    ps = args.page_size
    pages_needed = max(sum(-(-t // ps) for t in _lengths(s)) for s in shapes)
    most_requests = max(len(s.extends) + len(s.decodes) for s in shapes)
    longest = max(max(_lengths(s)) for s in shapes)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.backend,
        page_size=ps,
        kv_cache_tokens=pages_needed * ps,
        max_running_requests=most_requests,
        max_model_len=longest,
        enable_prefix_cache=False,
        enable_cuda_graph=False,
    )
    executor = ModelExecutor(config)
    core = build_core(config, executor)
    runner = executor.runner
    assert runner is not None
    vocab_size = core.spec.vocab_size
    bench = PlanBench(executor, core.kv, vocab_size, args.seed, cpu_clock=args.clock == "cpu")

    features: list[StepFeatures] = []
    seconds: list[float] = []
    for i, shape in enumerate(shapes):
        plan, seqs = bench.build(shape)
        for seq in seqs:
            core.kv.close(seq, cache=False)
        features.append(StepFeatures.of_plan(plan))
        seconds.append(bench.time(shape, args.repeats))
        print(f"[{i + 1}/{len(shapes)}] {_describe(shape)}: {seconds[-1] * 1e3:.2f} ms", flush=True)

    where = f"{args.model} {args.dtype} on {args.device}"
    if args.device == "cuda":
        where += f" ({torch.cuda.get_device_name()})"
    else:
        where += f" ({platform.machine()}, {torch.get_num_threads()} threads, {args.clock} clock)"
    where += f", backend {runner.backend_name}, page {ps}"
    model = CostModel.fit(features, seconds, description=f"fitted: {where}")
    errors = model.relative_errors(features, seconds)
    print("\nplan                                      measured ms  predicted ms  error")
    for shape, f, t, e in zip(shapes, features, seconds, errors, strict=True):
        print(
            f"{_describe(shape):<42}{t * 1e3:>11.2f}{model.time_of(f) * 1e3:>14.2f}{e * 100:>6.1f}%"
        )
    p50, p90 = np.percentile(errors, [50, 90])
    model = CostModel(
        *model.coefficients,
        description=f"{model.description}; relative error p50 "
        f"{p50 * 100:.1f}% p90 {p90 * 100:.1f}% over {len(shapes)} plans",
    )
    model.save(args.out)
    print(f"\n{model}\nwritten to {args.out}")
    if args.samples_out:
        rows = [
            {"features": f.as_row()[1:], "seconds": t}
            for f, t in zip(features, seconds, strict=True)
        ]
        Path(args.samples_out).write_text(json.dumps(rows, indent=1) + "\n")
    return model


def _lengths(shape: PlanShape) -> list[int]:
    return [p + n for p, n in shape.extends] + list(shape.decodes)


def _describe(shape: PlanShape) -> str:
    parts = []
    if shape.extends:
        (p, n), count = shape.extends[0], len(shape.extends)
        parts.append(f"{count}x extend {n} on {p}")
    if shape.decodes:
        parts.append(f"{len(shape.decodes)}x decode @{shape.decodes[0]}")
    return " + ".join(parts)


if __name__ == "__main__":
    run_main(main)
