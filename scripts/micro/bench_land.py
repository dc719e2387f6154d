#!/usr/bin/env python
"""What landing a step costs on the loop thread, and how much of it is the text (detokenizing and
stop strings, done where the tokens land since the lifecycle decides every ending).

    python scripts/micro/bench_land.py --batches 1 16 64 --steps 200 --out /tmp/bench_land.json

The engine's real core (scheduler, lifecycle, radix tree) runs decode steps over an executor
that takes no time and "samples" the embedded model's tokens of an English text (so the
detokenizer sees real text); each request carries the embedded tokenizer's detokenizer and four
stop strings that never match (every token is scanned for all four). ``land`` is timed per
step, with the text and (the same requests, no ``Request.text``) without it. The last columns
set the text's cost against a CPU decode step of the same batch (``--step-ms``: the forward's
milliseconds at each batch; default: this repository's fp32 figures on the AVX2 machine,
docs/BENCHMARKS.md "Forward pass against the matmul floor", decode at context 256).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, StepOutput
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import build_core
from asyncengine.core.executor_api import KVLayout, ModelSpec
from asyncengine.executor.loader.default_model import tokenizer_dir
from asyncengine.script_main import run_main
from asyncengine.text.output_text import OutputText
from asyncengine.text.tokenizer import Tokenizer

STOP = ["</answer>", "###", "\n\nUser:", "END OF TEXT"]
TEXT = (
    "The engine keeps one event loop. Requests arrive, the scheduler orders them, and the "
    "model computes a batch of tokens on a worker thread while the loop streams the text of "
    "the previous step to every caller. Stop strings may arrive split over several tokens, so "
    "the tail of the text that could still become one is held back until a later token decides "
    "it. Every page of the key-value cache is free, held by a request, or owned by the tree. "
)
DEFAULT_STEP_MS = {1: 51.1, 16: 138.8, 64: 250.2, 128: 430.7}


class TextExecutor:
    """Samples the tokens of ``tokens`` in turn, instantly."""

    def __init__(self, tokens: Sequence[int], vocab_size: int) -> None:
        self.tokens = list(tokens)
        self.spec = ModelSpec(4096, vocab_size, (0,), 1)
        self.next = 0

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        return None

    def bind(self, layout: KVLayout) -> None:
        pass

    def execute(self, plan: BatchPlan) -> StepOutput:
        n = len(plan.sampling)
        out = [self.tokens[(self.next + i) % len(self.tokens)] for i in range(n)]
        self.next += n
        return StepOutput(out, [None] * n, forward_seconds=1e-3)


def land_seconds(tokenizer: Tokenizer, batch: int, steps: int, with_text: bool) -> list[float]:
    """Seconds of each decode step's ``land`` for ``batch`` requests."""
    tokens = tokenizer.encode(TEXT * 4)
    executor = TextExecutor(tokens, 49152)
    config = EngineConfig(kv_cache_tokens=batch * (steps + 64) * 2, max_running_requests=batch)
    core = build_core(config, executor)
    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True, stop=STOP)
    for i in range(batch):
        req = Request(f"r{i}", [1 + i, 2, 3, 4], params, 0.0)
        if with_text:
            req.text = OutputText(tokenizer.detokenizer(True, req.prompt_ids), STOP)
        core.add(req)
    timings = []
    while core.has_work():
        plan = core.launch()
        assert plan is not None
        output = executor.execute(plan)
        start = time.perf_counter()
        core.land(plan, output)
        if not plan.extends:
            timings.append(time.perf_counter() - start)
    return timings[:steps]


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (median)")
    parser.add_argument(
        "--step-ms", type=float, nargs="*", default=None, help="a CPU decode step, per batch"
    )
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    step_ms = DEFAULT_STEP_MS
    if args.step_ms:
        if len(args.step_ms) != len(args.batches):
            raise ValueError("give one --step-ms per --batches")
        step_ms = dict(zip(args.batches, args.step_ms, strict=True))
    missing = [b for b in args.batches if b not in step_ms]
    if missing:
        raise ValueError(f"no CPU step time for batch {missing}: give --step-ms")
    tokenizer = Tokenizer(tokenizer_dir("smollm2-135m"))
    rows = []
    print(f"{'batch':>5} {'land us':>9} {'no text us':>11} {'text us/tok':>12} "
          f"{'land % step':>12} {'text % step':>12}")  # fmt: skip
    for batch in args.batches:
        runs = {
            flag: [statistics.median(land_seconds(tokenizer, batch, args.steps, flag))
                   for _ in range(args.repeats)]
            for flag in (True, False)
        }  # fmt: skip
        land, bare = statistics.median(runs[True]), statistics.median(runs[False])
        step = step_ms[batch] / 1e3
        row = {
            "batch": batch,
            "land_us": land * 1e6,
            "land_without_text_us": bare * 1e6,
            "text_us_per_token": (land - bare) * 1e6 / batch,
            "land_share_of_cpu_step": land / step,
            "text_share_of_cpu_step": (land - bare) / step,
            "cpu_step_ms": step_ms[batch],
        }
        rows.append(row)
        print(f"{batch:>5} {row['land_us']:>9.1f} {row['land_without_text_us']:>11.1f} "
              f"{row['text_us_per_token']:>12.2f} {row['land_share_of_cpu_step']:>11.2%} "
              f"{row['text_share_of_cpu_step']:>11.2%}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    run_main(lambda: main() and 0)
