"""Forward-pass speed of the CPU executor next to the floor set by this machine's matmul rate.

For each dtype: decode steps (one new token for each of B requests at context C), single
prefills and, with ``--ragged N``, a step of N prompts of very different lengths ("ragged":
lognormal, median 96, 15..290 tokens, seeded) beside N prompts of their mean length
("uniform", the same tokens without the spread), timed through ``ModelRunner.forward_logits``
(median of repeats). The floor of each
row is the time of the same forward's GEMMs alone (every layer's qkv, o, gate_up and down
projections at that many tokens, and the LM head at the sampled rows), timed in the same run
with the model's own weights, layer after layer as the forward streams them: ``fraction = floor / measured`` says how close the whole forward
(attention, norms, rotary, gathers, Python) comes to the hardware's matmul limit.

    .venv/bin/python scripts/micro/bench_forward.py                      # embedded default model
    .venv/bin/python scripts/micro/bench_forward.py --model path/to/hf_dir --dtypes bf16 --batches 1,64
    .venv/bin/python scripts/micro/bench_forward.py --dtypes fp32 --batches 64 --ragged 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model import LlamaModel
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import DEFAULT_MODEL, load_hf_config, load_weights, resolve_model
from asyncengine.executor.runner import ModelRunner
from asyncengine.script_main import run_main

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(slots=True)
class Row:
    dtype: str
    phase: str  # "decode", "prefill", "ragged" or "uniform" (prefills of several prompts)
    batch: int  # requests in the forward
    context: int  # kv length each request attends over (decode) or longest prompt (prefill)
    tokens: int  # tokens computed by the forward
    forward_ms: float
    tokens_per_s: float
    floor_ms: float  # the forward's GEMMs alone
    fraction_of_floor: float


TIMERS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = _clock()
        fn()
        samples.append(_clock() - start)
    return statistics.median(samples)


def gemm_floor_seconds(model: LlamaModel, num_tokens: int, num_sampled: int, repeats: int) -> float:
    """The forward's matmuls alone: every layer's projections (its own weights, so they stream
    from memory as in the forward; through the same ``Linear`` objects, so prepacked on a CPU
    as in the forward) at num_tokens rows, plus the LM head at the sampled rows."""
    c = model.config
    x = torch.randn(num_tokens, c.hidden_size).to(model.dtype)
    x_attn = torch.randn(num_tokens, c.q_size).to(model.dtype)
    x_inter = torch.randn(num_tokens, c.intermediate_size).to(model.dtype)
    x_head = torch.randn(num_sampled, c.hidden_size).to(model.dtype)

    def gemms() -> None:
        for layer in model.layers:
            layer.qkv(x)
            layer.o_proj(x_attn)
            layer.gate_up(x)
            layer.down(x_inter)
        model.lm_head(x_head)

    with torch.inference_mode():
        return median_seconds(gemms, repeats)


class Bench:
    def __init__(
        self, config: ModelConfig, weights: dict, dtype: torch.dtype, args: argparse.Namespace
    ):
        self.config = config
        self.args = args
        page_size = args.page_size
        longest = max(args.context, max(args.prefill_lens), RAGGED_MAX_LEN if args.ragged else 0)
        self.pages_per_request = -(-(longest + 1) // page_size)
        max_batch = max(*args.batches, args.ragged)
        num_pages = self.pages_per_request * max_batch
        self.pool = KVPool.for_model(config, num_pages, page_size, dtype)
        # Keys/values of the "cached" context: any finite values time the same.
        self.pool.k.uniform_(-1, 1)
        self.pool.v.uniform_(-1, 1)
        self.table = PageTable.contiguous(max_batch, self.pages_per_request)
        self.runner = ModelRunner(
            config, weights, self.pool, self.table, dtype, sampler=_NoSampler()
        )

    def decode(self, batch: int) -> tuple[float, float]:
        ctx = self.args.context
        plan = BatchPlan(
            step=0,
            decodes=[Segment(f"r{b}", b, [100 + b % 1000], ctx, True) for b in range(batch)],
        )
        seconds = median_seconds(lambda: self.runner.forward_logits(plan), self.args.repeats)
        floor = gemm_floor_seconds(self.runner.model, batch, batch, self.args.repeats)
        return seconds, floor

    def prefill(self, length: int) -> tuple[float, float]:
        tokens = [100 + i % 1000 for i in range(length)]
        plan = BatchPlan(step=0, extends=[Segment("p", 0, tokens, 0, True)])
        seconds = median_seconds(lambda: self.runner.forward_logits(plan), self.args.repeats)
        floor = gemm_floor_seconds(self.runner.model, length, 1, self.args.repeats)
        return seconds, floor

    def prefills(self, lengths: list[int]) -> tuple[float, float]:
        """One step prefilling len(lengths) prompts from position 0."""
        extends = [
            Segment(f"p{i}", i, [100 + (i * 7 + j) % 1000 for j in range(n)], 0, True)
            for i, n in enumerate(lengths)
        ]
        plan = BatchPlan(step=0, extends=extends)
        seconds = median_seconds(lambda: self.runner.forward_logits(plan), self.args.repeats)
        floor = gemm_floor_seconds(self.runner.model, sum(lengths), len(lengths), self.args.repeats)
        return seconds, floor


RAGGED_MIN_LEN, RAGGED_MEDIAN_LEN, RAGGED_MAX_LEN = 15, 96, 290


def ragged_lengths(count: int, seed: int = 0) -> list[int]:
    """Prompt lengths of a step of chat-like requests: lognormal, clipped to 15..290."""
    draws = np.random.default_rng(seed).lognormal(np.log(RAGGED_MEDIAN_LEN), 0.7, count)
    return np.clip(draws, RAGGED_MIN_LEN, RAGGED_MAX_LEN).astype(int).tolist()


class _NoSampler:
    def sample(self, logits: torch.Tensor, sampling: list) -> tuple[list[int], list[None]]:
        raise AssertionError("the benchmark times forward_logits only")


def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        path = resolve_model(args.model, dtype)
        config = ModelConfig.from_hf_dict(load_hf_config(path))
        bench = Bench(config, load_weights(path, dtype), dtype, args)
        for batch in args.batches:
            seconds, floor = bench.decode(batch)
            rows.append(_row(dtype_name, "decode", batch, args.context, batch, seconds, floor))
            _print_row(rows[-1])
        for length in args.prefill_lens:
            seconds, floor = bench.prefill(length)
            rows.append(_row(dtype_name, "prefill", 1, length, length, seconds, floor))
            _print_row(rows[-1])
        if args.ragged:
            ragged = ragged_lengths(args.ragged)
            uniform = [round(sum(ragged) / len(ragged))] * len(ragged)
            for phase, lengths in (("ragged", ragged), ("uniform", uniform)):
                seconds, floor = bench.prefills(lengths)
                rows.append(
                    _row(
                        dtype_name, phase, len(lengths), max(lengths), sum(lengths), seconds, floor
                    )
                )
                _print_row(rows[-1])
        del bench
    return rows


def _row(
    dtype: str, phase: str, batch: int, context: int, tokens: int, s: float, floor: float
) -> Row:
    return Row(dtype, phase, batch, context, tokens, s * 1e3, tokens / s, floor * 1e3, floor / s)


HEADER = f"{'dtype':5} {'phase':7} {'batch':>5} {'ctx':>5} {'ms':>9} {'tok/s':>9} {'floor ms':>9} {'of floor':>8}"


def _print_row(r: Row) -> None:
    print(
        f"{r.dtype:5} {r.phase:7} {r.batch:>5} {r.context:>5} {r.forward_ms:>9.2f} "
        f"{r.tokens_per_s:>9.1f} {r.floor_ms:>9.2f} {r.fraction_of_floor:>8.0%}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or HF directory")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    parser.add_argument("--batches", default="1,4,16,64,128,256", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=256, help="decode kv length per request")
    parser.add_argument("--prefill-lens", default="128,512", help="single-prefill prompt lengths")
    parser.add_argument(
        "--ragged",
        type=int,
        default=0,
        help="also time a step of this many prompts of lognormal lengths 15..290, and of as "
        "many prompts of their mean length (0: skip)",
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--timer",
        choices=sorted(TIMERS),
        default="wall",
        help="wall clock, or this process's CPU time (with --threads 1: its busy time, the "
        "robust measure on a machine that other jobs share)",
    )
    parser.add_argument("--json", type=Path, default=Path("bench_forward.json"))
    args = parser.parse_args()
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtypes {unknown}: use fp32 or bf16 (float16 is refused on CPU)")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prefill_lens = [int(n) for n in args.prefill_lens.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    global _clock
    _clock = TIMERS[args.timer]

    print(
        f"model {args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(HEADER)
    rows = run(args)
    meta = {
        "model": args.model,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_end": os.getloadavg()[0],
        "page_size": args.page_size,
        "ragged_prompts": args.ragged,
        "repeats": args.repeats,
        "timer": f"{args.timer}, median of repeats",
    }
    args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    run_main(main)
