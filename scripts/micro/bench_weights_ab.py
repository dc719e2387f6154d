"""One model's forward with its weights as a ``quantization`` setting loads them (default: the
GGUF as stored) against the same model expanded to float32 (``none``), per decode batch size and
prefill length: the check that the default makes no batch size slower.

Both runners live in one process with their own KV pools; for each shape they run alternating
(A, B, A, B...), so a machine that other work keeps busy slows both alike: the ratio is the
figure, the milliseconds are the share of the cores the process got (the load is printed).
Each sample times ``ModelRunner.forward_logits`` (the forward and the LM head) of B one-token
decodes at context C, or of one prompt of L tokens. Peak and current RSS after each runner's
load and after the runs tell what each weight form holds (a quantized projection keeps a dense
copy once a call of ``DENSE_FROM_ROWS`` rows or more has used it).

    .venv/bin/python scripts/micro/bench_weights_ab.py                           # auto vs none
    .venv/bin/python scripts/micro/bench_weights_ab.py --quantization int8 --batches 1,16,64
    .venv/bin/python scripts/micro/bench_weights_ab.py --threads 1 --cpu-time    # on a busy machine
    .venv/bin/python scripts/micro/bench_weights_ab.py --dtype bfloat16          # an AVX-512 BF16 CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import DEFAULT_MODEL
from asyncengine.executor.loader.quantized import load_model
from asyncengine.executor.runner import ModelRunner
from asyncengine.script_main import run_main

PAGE_SIZE = 16


def rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB."""
    values: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", float("nan")), values.get("VmHWM", float("nan"))


def make_runner(
    model: str, quantization: str, rows: int, context: int, dtype: torch.dtype = torch.float32
) -> tuple[ModelRunner, str]:
    """A runner of ``model`` as ``quantization`` loads it, its activations and K/V pool in
    ``dtype`` (bfloat16: what ``dtype = "auto"`` picks on an AVX-512 BF16 CPU)."""
    loaded = load_model(model, dtype, torch.device("cpu"), quantization)
    config = ModelConfig.from_hf_dict(json.loads((loaded.model_dir / "config.json").read_text()))
    pages = -(-(context + 2) // PAGE_SIZE)
    pool = KVPool.for_model(config, pages * rows, PAGE_SIZE, dtype)
    pool.k.uniform_(-1, 1)  # the "cached" context: any finite values time the same
    pool.v.uniform_(-1, 1)
    table = PageTable.contiguous(rows, pages)
    return ModelRunner(config, loaded.weights, pool, table, dtype), loaded.summary()


def decode_plan(batch: int, context: int) -> BatchPlan:
    return BatchPlan(
        step=0, decodes=[Segment(f"r{b}", b, [100 + b], context, True) for b in range(batch)]
    )


def prefill_plan(length: int) -> BatchPlan:
    return BatchPlan(step=0, extends=[Segment("p", 0, [100 + i for i in range(length)], 0, True)])


def ab(
    runners: dict[str, ModelRunner], plan: BatchPlan, repeats: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Median ms of forward_logits per runner, alternating; the first round warms up."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for repeat in range(repeats + 1):
        for name, runner in runners.items():
            start = clock()
            runner.forward_logits(plan)
            if repeat:
                samples[name].append(clock() - start)
    return {name: statistics.median(values) * 1e3 for name, values in samples.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quantization", default="auto", choices=("auto", "int8"))
    parser.add_argument("--batches", default="1,8,16,24,31,32,48,64,128")
    parser.add_argument("--prefills", default="16,64,256", help="prompt lengths (one request)")
    parser.add_argument("--context", type=int, default=256, help="kv length of each decode")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="activations and K/V pool (none: its weights in this dtype)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    batches = [int(b) for b in args.batches.split(",") if b]
    prefills = [int(p) for p in args.prefills.split(",") if p]
    rows = max(batches)
    context = max([args.context + 1, *prefills])
    load_start = os.getloadavg()[0]
    runners: dict[str, ModelRunner] = {}
    memory: dict[str, dict[str, float]] = {}
    weights: dict[str, str] = {}
    for name in (args.quantization, "none"):  # the quantized one first: its RSS is read alone
        runners[name], weights[name] = make_runner(
            args.model, name, rows, context, getattr(torch, args.dtype)
        )
        rss, peak = rss_mb()
        memory[name] = {"rss_after_load_mb": rss, "peak_after_load_mb": peak}
    results: list[dict[str, Any]] = []
    shapes = [("decode", b, decode_plan(b, args.context)) for b in batches]
    shapes += [("prefill", n, prefill_plan(n)) for n in prefills]
    for kind, size, plan in shapes:
        ms = ab(runners, plan, args.repeats, clock)
        row = {"kind": kind, "size": size, **{f"{k}_ms": v for k, v in ms.items()}}
        row["ratio"] = ms["none"] / ms[args.quantization]  # > 1: the quantization is faster
        results.append(row)
        print(
            f"{kind:7s} {size:4d}: {args.quantization} {ms[args.quantization]:8.2f} ms, "
            f"none {ms['none']:8.2f} ms, speed-up {row['ratio']:.2f}x",
            flush=True,
        )
    rss, peak = rss_mb()
    result = {
        "model": args.model,
        "weights": weights,
        "threads": torch.get_num_threads(),
        "clock": "cpu" if args.cpu_time else "wall",
        "dtype": args.dtype,
        "context": args.context,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "rows": results,
        "memory_mb": {**memory, "after_runs": {"rss_mb": rss, "peak_mb": peak}},
    }
    print(
        f"weights: {weights}; load {load_start:.2f} -> {result['load_end']:.2f}; "
        f"RSS MB: {json.dumps(result['memory_mb'])}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    run_main(main)
