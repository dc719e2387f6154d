"""Decode steps of a quantized model: the fused native step (executor/cpu/native_decode.py) against
the torch path of the same model, per decode batch size, and where a batch-1 step's time goes.

Both paths run in one process on one model and pool, alternating step by step (A, B, A, B...),
so a machine that other work keeps busy slows both alike: compare the ratio, not the absolute
figures, when the load is high (printed). Each row times ``ModelRunner.forward_logits`` (the
forward and the LM head) of B one-token decodes at context C. The breakdown splits a batch-1
step of each path: the projections (torch path: the summed time inside its quantized
projections), the fused C call, the LM head, greedy sampling of one row, and the rest
(embedding, plan to tensors, attention, norms, rotary, Python).

    .venv/bin/python scripts/micro/bench_decode_step.py                       # embedded Q4_1 file
    .venv/bin/python scripts/micro/bench_decode_step.py --batches 1,8,16,24,31 --context 256
    .venv/bin/python scripts/micro/bench_decode_step.py --threads 1 --cpu-time   # on a busy machine
    .venv/bin/python scripts/micro/bench_decode_step.py --batches 16,32,64,128 --dense  # + dense column

The fused column is the fused step wherever the model's step takes the batch
(``native_decode.max_rows``), else the torch path as the engine would run it. ``--dense`` adds a
third path: the torch path with every projection on the dense float32 product (the quantized
weights dequantized once), to see the crossover (executor/layers/linear.py) at whole-step level.

``--baseline-library`` adds a column: the fused step on another build of
kernels/cpu/cpu_decode_step.c for the run's pool (say main's, from its kernel cache: the same C
interface; with ``--dtype bfloat16`` its -DKV_BF16 build), alternating
with this tree's, for a before/after within one process on a busy machine:

    .venv/bin/python scripts/micro/bench_decode_step.py --batches 16,64 --context 512 \
        --baseline-library ~/.cache/asyncengine/kernels/cpu_decode_step-<main's hash>.so

``--quantization none`` runs the dense float32 checkpoint, whose projections are F32 rows (the
fused step takes them like any format); a fourth path then runs the same weights as dense oneDNN
``Linear``s (``ASYNCENGINE_F32_ROWS=0``: the engine before F32 rows), in its own runner over
the same pool. With ``--dtype bfloat16`` the checkpoint is expanded to bfloat16: BF16 rows
against oneDNN's bfloat16 ``Linear``s (the engine before BF16 rows):

    .venv/bin/python scripts/micro/bench_decode_step.py --quantization none --batches 1 --repeats 20
    .venv/bin/python scripts/micro/bench_decode_step.py --quantization none --dtype bfloat16 \
        --batches 1,2,4 --context 443 --threads 1 --cpu-time

``--dtype bfloat16`` runs the model as a bfloat16 model over a bfloat16 pool (the fused step's
-DKV_BF16 build against the bfloat16 torch path), as ``dtype = "auto"`` runs it on an AVX-512
BF16 CPU:

    .venv/bin/python scripts/micro/bench_decode_step.py --dtype bfloat16 --batches 1 --context 443

``--half-pool`` adds the fused step over a float16 K/V pool (``kv_cache_dtype = "float16"``,
what ``auto`` picks for a quantized model on an F16C CPU), in its own runner, alternating with
the float32 pool's; attention's share grows with the context:

    .venv/bin/python scripts/micro/bench_decode_step.py --batches 16,64,128 --context 443 --half-pool

``--shape`` runs a random-weight model of a real shape in a llama-quantize mix instead of a
file (scripts/micro/synthetic_model.py: no GGUF, no llama.cpp), and the table gains the weight
bytes a batch-1 step streams and the GB/s that makes (a batch-1 step is bound by them):

    .venv/bin/python scripts/micro/bench_decode_step.py --shape llama-3.2-1b --mix Q4_K_M \
        --batches 1,4,16 --context 256

``--cpu-time`` times with this process's CPU time instead of the wall clock: with one thread it
is the step's own cost whatever else runs on the machine (with more, it counts the threads'
waiting too).
"""

from __future__ import annotations

import argparse
import ctypes
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
from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.cpu import native_decode
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.linear import FLOAT_ROWS_ENV, QuantizedLinear
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import DEFAULT_MODEL
from asyncengine.executor.loader.quantized import load_model
from asyncengine.executor.runner import ModelRunner
from asyncengine.executor.sampler import Sampler
from asyncengine.kernels.cpu import decode_step_native
from asyncengine.script_main import run_main

_clock = time.perf_counter
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        dtype = DTYPES[args.dtype]  # the activations' and the pool's
        if args.shape:
            from scripts.micro.synthetic_model import synthetic_weights

            hf_config, weights = synthetic_weights(args.shape, args.mix)
            self.summary = f"{args.shape} {args.mix} (random weights)"
        else:
            loaded = load_model(args.model, dtype, torch.device("cpu"), args.quantization)
            hf_config = json.loads((loaded.model_dir / "config.json").read_text())
            weights = dict(loaded.weights)
            self.summary = loaded.summary()
        config = ModelConfig.from_hf_dict(hf_config)
        self.args = args
        page_size = 16
        pages = -(-(args.context + 2) // page_size)
        rows = max(args.batches)
        pool = KVPool.for_model(config, pages * rows, page_size, dtype)
        pool.k.uniform_(-1, 1)  # the "cached" context: any finite values time the same
        pool.v.uniform_(-1, 1)
        table = PageTable.contiguous(rows, pages)
        self.runner = ModelRunner(config, dict(weights), pool, table, dtype)
        self.onednn: ModelRunner | None = None
        if args.quantization == "none":  # the same weights as dense Linears, for comparison
            previous = os.environ.get(FLOAT_ROWS_ENV)
            os.environ[FLOAT_ROWS_ENV] = "0"
            try:
                self.onednn = ModelRunner(config, dict(weights), pool, table, dtype)
            finally:
                if previous is None:
                    del os.environ[FLOAT_ROWS_ENV]
                else:
                    os.environ[FLOAT_ROWS_ENV] = previous
        self.half: ModelRunner | None = None
        if args.half_pool:  # the same weights over a float16 pool of the same slots
            half_pool = KVPool.for_model(config, pages * rows, page_size, torch.float16)
            half_pool.k.uniform_(-1, 1)
            half_pool.v.uniform_(-1, 1)
            self.half = ModelRunner(config, dict(weights), half_pool, table, torch.float32)
        self.fused = self.runner.model.native_decode
        self.crossovers = {
            linear: linear.dense_from_rows
            for layer in self.runner.model.layers
            for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            if isinstance(linear, QuantizedLinear)
        }
        if self.fused is None:
            raise ValueError(f"the fused decode step does not cover {args.model} here")
        model = self.runner.model
        self.step_bytes = sum(
            getattr(linear, "nbytes", 0)
            for layer in model.layers
            for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ) + getattr(model.lm_head, "nbytes", 0)
        self.libraries = decode_step_native._library
        self.dtype = dtype
        self.library = self.libraries(dtype)  # the build for this run's pool
        self.baseline = None
        if args.baseline_library:
            self.baseline = ctypes.CDLL(str(args.baseline_library))
            assert self.library is not None
            # a build for another pool reads this one's slots wrongly (a crash, not a figure)
            theirs, ours = (lib.asyncengine_kv_element() for lib in (self.baseline, self.library))
            if theirs != ours:
                raise SystemExit(
                    f"--baseline-library is a build for another K/V pool ({theirs}-byte elements, "
                    f"this run's {ours}): build it with this pool's flags "
                    f"{decode_step_native.KV_BUILD_FLAGS[dtype]}"
                )
            for name in ("asyncengine_decode_step", "asyncengine_decode_step_planned"):
                step, ours = getattr(self.baseline, name), getattr(self.library, name)
                step.restype, step.argtypes = ours.restype, ours.argtypes

    def plan(self, batch: int) -> BatchPlan:
        ctx = self.args.context
        return BatchPlan(
            step=0,
            decodes=[Segment(f"r{b}", b, [100 + b], ctx, True) for b in range(batch)],
        )

    def use(self, fused: bool, dense: bool = False, baseline: bool = False) -> None:
        library = self.baseline if baseline else self.library
        libraries = self.libraries

        def pick(kv_dtype: torch.dtype = torch.float32) -> Any:
            return library if kv_dtype == self.dtype else libraries(kv_dtype)

        decode_step_native._library = pick  # type: ignore[assignment]
        self.runner.model.native_decode = self.fused if fused else None
        for linear, crossover in self.crossovers.items():
            linear.dense_from_rows = 1 if dense else crossover

    def ab(self, batch: int) -> dict[str, float]:
        """Median ms of forward_logits per path, the paths alternating step by step."""
        plan = self.plan(batch)
        paths = {"fused": (True, False, False), "torch": (False, False, False)}
        if self.args.dense:
            paths["dense"] = (False, True, False)
        if self.baseline is not None:
            paths["baseline"] = (True, False, True)
        runners = {name: self.runner for name in paths}
        if self.onednn is not None:
            paths["onednn"] = (False, False, False)
            runners["onednn"] = self.onednn
        if self.half is not None:
            paths["half"] = (True, False, False)
            runners["half"] = self.half
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for repeat in range(self.args.repeats + 1):
            for name, (fused, dense, baseline) in paths.items():
                self.use(fused, dense, baseline)
                start = _clock()
                runners[name].forward_logits(plan)
                if repeat:  # the first round warms up
                    samples[name].append(_clock() - start)
        self.use(True)
        ms = {name: statistics.median(times) * 1e3 for name, times in samples.items()}
        row = {"batch": batch, "fused_taken": batch <= native_decode.max_rows(self.fused),
               "fused_ms": ms["fused"], "torch_ms": ms["torch"],
               "speedup": ms["torch"] / ms["fused"]}  # fmt: skip
        if "dense" in ms:
            row["dense_ms"] = ms["dense"]
        if "baseline" in ms:
            row["baseline_fused_ms"] = ms["baseline"]
        if "onednn" in ms:
            row["onednn_ms"] = ms["onednn"]
        if "half" in ms:
            row["half_pool_fused_ms"] = ms["half"]
        return row

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Where a batch-1 step of each path goes (median ms per part over the repeats)."""
        plan = self.plan(1)
        model = self.runner.model
        parts: dict[str, list[float]] = {}
        timed: dict[str, float] = {}

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed_call(*args: Any) -> Any:
                start = _clock()
                try:
                    return fn(*args)
                finally:
                    timed[name] = timed.get(name, 0.0) + _clock() - start

            return timed_call

        projections = [
            (layer, name)
            for layer in model.layers
            for name in ("qkv", "o_proj", "gate_up", "down")
            if isinstance(getattr(layer, name), QuantizedLinear)
        ]
        originals = {(id(layer), name): getattr(layer, name) for layer, name in projections}
        head = model.lm_head
        sampler = Sampler()
        greedy = [SamplingInfo(SamplingParams(temperature=0.0), [], [])]
        assert self.fused is not None
        fused_step = self.fused.step
        out: dict[str, dict[str, float]] = {}
        for fused in (True, False):
            self.use(fused)
            for layer, name in projections:
                inner = originals[(id(layer), name)]
                setattr(layer, name, wrap("projections", inner) if not fused else inner)
            model.lm_head = wrap("lm_head", head)  # type: ignore[assignment]
            if fused:
                self.fused.step = wrap("fused_step", fused_step)  # type: ignore[method-assign]
            parts = {}
            for repeat in range(self.args.repeats + 1):
                timed.clear()
                start = _clock()
                logits = self.runner.forward_logits(plan)
                total = _clock() - start
                sample_start = _clock()
                sampler.sample(logits, greedy)
                timed["sample"] = _clock() - sample_start
                timed["rest"] = total - sum(v for k, v in timed.items() if k != "sample")
                timed["step"] = total + timed["sample"]
                if repeat:
                    for key, value in timed.items():
                        parts.setdefault(key, []).append(value)
            out["fused" if fused else "torch"] = {
                k: statistics.median(v) * 1e3 for k, v in parts.items()
            }
            model.lm_head = head
            if fused:
                self.fused.step = fused_step  # type: ignore[method-assign]
        for layer, name in projections:
            setattr(layer, name, originals[(id(layer), name)])
        self.use(True)
        return out


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} ({result['weights']}), {result.get('dtype', 'float32')}, "
        f"context {result['context']}, "
        f"{result['threads']} threads, {result['clock']} time, load {result['load_start']:.2f} -> {result['load_end']:.2f}",
        "",
        "| decode batch | fused ms | torch path ms | fused speed-up | torch path, dense ms "
        "| baseline fused ms | fused vs baseline | dense oneDNN Linears ms "
        "| fused, float16 pool ms | float16 pool gain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        fused = f"{row['fused_ms']:.2f}" + ("" if row["fused_taken"] else " (torch path)")
        dense = f"{row['dense_ms']:.2f}" if "dense_ms" in row else "-"
        base, gain = "-", "-"
        if "baseline_fused_ms" in row:
            base = f"{row['baseline_fused_ms']:.2f}"
            gain = f"{row['baseline_fused_ms'] / row['fused_ms']:.2f}x"
        onednn = f"{row['onednn_ms']:.2f}" if "onednn_ms" in row else "-"
        half, half_gain = "-", "-"
        if "half_pool_fused_ms" in row:
            half = f"{row['half_pool_fused_ms']:.2f}"
            half_gain = f"{row['fused_ms'] / row['half_pool_fused_ms']:.2f}x"
        lines.append(
            f"| {row['batch']} | {fused} | {row['torch_ms']:.2f} | {row['speedup']:.2f}x | {dense} "
            f"| {base} | {gain} | {onednn} | {half} | {half_gain} |"
        )
    step_bytes = result.get("step_weight_bytes", 0)
    for row in result["rows"]:
        if row["batch"] == 1 and step_bytes:
            lines += [
                "",
                f"a batch-1 step streams {step_bytes / 1e6:.0f} MB of weights: fused "
                f"{step_bytes / row['fused_ms'] / 1e6:.1f} GB/s, torch path "
                f"{step_bytes / row['torch_ms'] / 1e6:.1f} GB/s",
            ]
    parts = ("projections", "fused_step", "lm_head", "sample", "rest", "step")
    lines += ["", "batch-1 step (ms): | path | " + " | ".join(parts) + " |"]
    for path, row in result["breakdown"].items():
        cells = [f"{row[p]:.2f}" if p in row else "-" for p in parts]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "int8", "none"),
        help="none: the dense checkpoint in --dtype (its F32 / BF16 rows in the fused step)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=tuple(DTYPES),
        help="the activations and the K/V pool (bfloat16: the step's -DKV_BF16 build)",
    )
    parser.add_argument(
        "--shape", default=None, help="a random model of this shape (synthetic_model.SHAPES)"
    )
    parser.add_argument("--mix", default="Q4_K_M", help="its formats (synthetic_model.MIXES)")
    parser.add_argument("--batches", default="1,2,4,8,16,24,31")
    parser.add_argument("--context", type=int, default=64, help="kv length of each request")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall")
    parser.add_argument(
        "--dense", action="store_true", help="also the torch path on the dense float32 product"
    )
    parser.add_argument(
        "--baseline-library",
        type=Path,
        default=None,
        help="also the fused step on this build of cpu_decode_step (.so), alternating",
    )
    parser.add_argument(
        "--half-pool",
        action="store_true",
        help="also the fused step over a float16 K/V pool (its own runner), alternating",
    )
    args = parser.parse_args(argv)
    if args.dtype != "float32" and args.half_pool:
        parser.error("--half-pool compares float32 runs: --dtype float32")
    global _clock
    _clock = time.process_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    args.batches = [int(b) for b in args.batches.split(",")]
    load_start = os.getloadavg()[0]
    bench = Bench(args)
    with torch.inference_mode():
        rows = [bench.ab(batch) for batch in args.batches]
        breakdown = bench.breakdown()
    result = {
        "model": args.shape or args.model,
        "weights": bench.summary,
        "step_weight_bytes": bench.step_bytes,
        "context": args.context,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "clock": "CPU" if args.cpu_time else "wall",
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "rows": rows,
        "breakdown": breakdown,
    }
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run_main(main)
