"""Where a many-row decode step of a real GGUF model goes, and what the K formats' AMX product
(kernels/cpu/cpu_quant_amx.c) or int8 product (cpu_quant_i8gemm.c) changes in it:
``ModelRunner.forward_logits`` of B one-token decodes at context C, the projections on the path
the engine takes ("quant": the AMX or int8 product where the crossovers give it) against the same
projections on the dense bfloat16 product ("dense"), in one process, alternating step by step (a busy machine slows both alike: compare the ratio). Per path, the step splits into the
layers' projections, the LM head, greedy sampling and the rest (embedding, attention, norms,
rotary, Python), and the layers' projections by kind (SwiGLU in ``down``'s: a down projection
on the int8 product makes it itself). Without ``--model``, a random model of
``--shape`` in ``--mix``'s formats (scripts/micro/synthetic_model.py: no GGUF file needed).
``--baseline-library``: a third path, "base", the AMX product of another build of
cpu_quant_amx.c (e.g. the main branch's; scripts/micro/bench_amx_ab.py shows how to build one).

    .venv/bin/python scripts/micro/bench_many_rows_step.py --shape qwen2.5-1.5b --mix Q4_K_M \\
        --batches 32 --threads 1 --cpu-time --baseline-library /tmp/amx_main.so

    .venv/bin/python scripts/micro/bench_many_rows_step.py \\
        --model ~/.cache/asyncengine/models/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf --batches 8,16,32,64
    .venv/bin/python scripts/micro/bench_many_rows_step.py --model ... --threads 1 --cpu-time
    .venv/bin/python scripts/micro/bench_many_rows_step.py --model ... --dtype float32  # AVX2's

``--vs-expanded``: each GGUF (``--model`` repeated, or comma-separated) as the engine keeps it
quantized (``quantization auto``) against the same file expanded to bfloat16 at load (what
``--quantization none --dtype bfloat16`` gives: the weights dequantized to dense bfloat16, the
oneDNN bfloat16 products), the engine's paths at every batch (the fused decode step where it
takes the batch), alternating step by step over one KV pool: decode step tok/s at each of
``--batches`` (default here 1,8,32,128,256) and prefill tok/s of ``--prefill`` tokens. Prints
quantized / expanded per cell (< 1: the format is slower than its bfloat16 expansion) and
writes JSON (``--out``). Holds both copies of a model at once (a 1B: ~2.5 GB expanded, ~5 GB
with oneDNN's packed copy, beside the quantized bytes and their dense copies).

    .venv/bin/python scripts/micro/bench_many_rows_step.py --vs-expanded \
        --model ~/.cache/asyncengine/models/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf,... \
        --repeats 3 --out /tmp/vs_expanded.json

``--i8-crossovers Q4_K,Q5_K,Q6_K``: as ``--amx-vs-dense`` for the int8 product
(scripts/micro/i8_crossovers.py; ``I8_BELOW_ROWS_BY_FORMAT``).

``--amx-vs-dense Q4_K,Q5_K,Q6_K``: no model; per projection of ``--shape``'s layer and its
LM head, the AMX product against the dense bfloat16 one at each of ``--batches`` (why
executor/layers/linear.py never gives a projection with the AMX product a dense copy):

    .venv/bin/python scripts/micro/bench_many_rows_step.py --amx-vs-dense Q4_K,Q5_K,Q6_K \
        --shape llama-3.2-1b --batches 48,128,256,1024,2048 --threads 2

``--amx-against i8``: the same against the int8 product (``AMX_FROM_ROWS_BY_FORMAT``: where the
AMX product takes over from it), e.g. ``--batches 16,24,28,32,48``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/micro: vs_expanded

import torch
from amx_vs_dense import run_amx_vs_dense
from bench_amx_ab import baseline_library, using
from i8_crossovers import run_i8_crossovers
from vs_expanded import run_vs_expanded

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.linear import Linear, QuantizedLinear
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader.quantized import load_model
from asyncengine.executor.runner import ModelRunner
from asyncengine.executor.sampler import Sampler
from asyncengine.script_main import run_main

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


class Step:
    """One model and pool; ``run`` times one forward + greedy sample, by part."""

    def __init__(self, args: argparse.Namespace) -> None:
        dtype = getattr(torch, args.dtype)
        if args.model:
            loaded = load_model(args.model, dtype, torch.device("cpu"), "auto")
            hf_config = json.loads((loaded.model_dir / "config.json").read_text())
            weights = dict(loaded.weights)
            self.summary = loaded.summary()
        else:  # a random model of --shape in --mix's formats (no GGUF file)
            from scripts.micro.synthetic_model import synthetic_weights

            hf_config, weights = synthetic_weights(args.shape, args.mix)
            self.summary = f"{args.shape} {args.mix} (random weights)"
        config = ModelConfig.from_hf_dict(hf_config)
        page_size = 16
        pages = -(-(args.context + 2) // page_size)
        rows = max(args.batches)
        pool = KVPool.for_model(config, pages * rows, page_size, dtype)
        pool.k.uniform_(-1, 1)
        pool.v.uniform_(-1, 1)
        self.runner = ModelRunner(config, weights, pool, PageTable.contiguous(rows, pages), dtype)
        self.runner.model.native_decode = None  # the many-row path, at every batch
        model = self.runner.model
        self.linears = [
            linear
            for layer in model.layers
            for linear in (getattr(layer, name) for name in PROJECTIONS)
            if isinstance(linear, QuantizedLinear)
        ]
        if isinstance(model.lm_head, QuantizedLinear):
            self.linears.append(model.lm_head)
        self.amx = {linear: bool(getattr(linear, "_amx", False)) for linear in self.linears}
        self.i8 = {linear: int(getattr(linear, "_i8_below", 0)) for linear in self.linears}
        self.context = args.context
        self.clock: Callable[[], float] = time.process_time if args.cpu_time else time.perf_counter
        self.sampler = Sampler()
        # as the engine after start-up: what is built stays out of the collector's passes (else
        # ~5% of a 32-row step is collections walking the model's objects)
        gc.collect()
        gc.freeze()

    def use_amx(self, on: bool) -> None:
        """The AMX and int8 products where the engine takes them (on), or neither."""
        for linear, taken in self.amx.items():
            linear._amx = on and taken
            linear._i8_below = self.i8[linear] if on else 0

    def run(self, batch: int) -> dict[str, float]:
        plan = BatchPlan(
            step=0,
            decodes=[Segment(f"r{b}", b, [100 + b], self.context, True) for b in range(batch)],
        )
        model = self.runner.model
        timed: dict[str, float] = {}
        clock = self.clock

        # each projection's calls timed through its class's entries (the model takes a fused one
        # by the projection's type, so the objects stay in place), the outermost call only: a
        # fused entry that falls back calls the projection itself
        names_of: dict[int, tuple[str, ...]] = {
            id(getattr(layer, name)): ("projections", name)
            for layer in model.layers
            for name in PROJECTIONS
        }
        names_of[id(model.lm_head)] = ("lm_head",)
        depth = [0]

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed_call(linear: Any, *args: Any) -> Any:
                names = names_of.get(id(linear), ())
                if depth[0] or not names:
                    return fn(linear, *args)
                depth[0] += 1
                start = clock()
                try:
                    return fn(linear, *args)
                finally:
                    depth[0] -= 1
                    for name in names:
                        timed[name] = timed.get(name, 0.0) + clock() - start

            return timed_call

        originals = [
            (cls, entry, cls.__dict__[entry])
            for cls in (Linear, QuantizedLinear)
            for entry in ("__call__", "silu_and_mul_product", "float32_out")
            if entry in cls.__dict__
        ]
        for cls, entry, fn in originals:
            setattr(cls, entry, wrap(fn))
        greedy = [SamplingInfo(SamplingParams(temperature=0.0), [], [])] * batch
        try:
            start = clock()
            logits = self.runner.forward_logits(plan)
            sample_start = clock()
            self.sampler.sample(logits, greedy)
            end = clock()
        finally:
            for cls, entry, fn in originals:
                setattr(cls, entry, fn)
        timed["sample"] = end - sample_start
        timed["step"] = end - start
        timed["rest"] = (
            timed["step"]
            - timed["sample"]
            - timed.get("projections", 0.0)
            - timed.get("lm_head", 0.0)
        )
        return timed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", action="append", default=[], help="a GGUF file (--vs-expanded: several)"
    )
    parser.add_argument("--batches", default=None, help="default 8,16,32,64 (1,8,32,128,256)")
    parser.add_argument("--vs-expanded", action="store_true", help="quantized vs bfloat16 (above)")
    parser.add_argument("--prefill", type=int, default=512, help="--vs-expanded's prompt tokens")
    parser.add_argument("--out", default=None, help="--vs-expanded: JSON here")
    parser.add_argument("--amx-vs-dense", default=None, help="K formats: per projection (above)")
    parser.add_argument(
        "--amx-against",
        default="dense",
        choices=("dense", "i8"),
        help="--amx-vs-dense' other product (above)",
    )
    parser.add_argument("--i8-crossovers", default=None, help="K formats: per projection (above)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the step's or --i8-crossovers' activations and dense product (float32: an AVX2 CPU's)",
    )
    parser.add_argument(
        "--shape",
        default="llama-3.2-1b",
        help="--amx-vs-dense' shape; without --model, a random model of it (synthetic_model)",
    )
    parser.add_argument("--mix", default="Q4_K_M", help="the random model's formats")
    parser.add_argument("--context", type=int, default=96, help="kv length of each request")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall")
    parser.add_argument(
        "--baseline-library",
        default=None,
        help="also the AMX product of this build of cpu_quant_amx.c (.so), alternating",
    )
    args = parser.parse_args(argv)
    if args.dtype != "bfloat16" and (args.vs_expanded or args.amx_vs_dense):
        parser.error("--dtype float32 times the step or --i8-crossovers (AMX takes bfloat16)")
    if args.threads:
        torch.set_num_threads(args.threads)
    default_batches = "1,8,32,128,256" if args.vs_expanded else "8,16,32,64"
    args.batches = [int(b) for b in (args.batches or default_batches).split(",")]
    models = [m for given in args.model for m in given.split(",") if m]
    if args.amx_vs_dense:
        return run_amx_vs_dense(args)
    if args.i8_crossovers:
        return run_i8_crossovers(args)
    if args.vs_expanded:
        return run_vs_expanded(models, args)
    if len(models) > 1:
        parser.error("one --model without --vs-expanded")
    args.model = models[0] if models else None
    step = Step(args)
    baseline = baseline_library(args.baseline_library) if args.baseline_library else None
    print(
        f"{step.summary}; threads {torch.get_num_threads()}; clock {'CPU' if args.cpu_time else 'wall'}"
    )
    rows = []
    with torch.inference_mode():
        for batch in args.batches:
            samples: dict[str, dict[str, list[float]]] = {"quant": {}, "dense": {}}
            if baseline is not None:
                samples["base"] = {}
            for repeat in range(args.repeats + 1):
                for path in samples:
                    step.use_amx(path != "dense")
                    with using(baseline if path == "base" else None):
                        timed = step.run(batch)
                    if repeat:  # the first round warms up (and builds the dense copies)
                        for key, value in timed.items():
                            samples[path].setdefault(key, []).append(value)
            step.use_amx(True)
            row: dict[str, Any] = {"batch": batch}
            for path, parts in samples.items():
                row[path] = {key: statistics.median(v) * 1e3 for key, v in parts.items()}
            rows.append(row)
            print(
                f"B={batch:4d} "
                + "  ".join(
                    f"{path}: step {row[path]['step']:7.1f} ms (proj {row[path].get('projections', 0):6.1f}, "
                    f"head {row[path].get('lm_head', 0):6.1f}, sample {row[path]['sample']:5.1f}, "
                    f"rest {row[path]['rest']:5.1f})"
                    for path in samples
                ),
                flush=True,
            )
            for path in samples:
                print(
                    f"       {path:5s} "
                    + ", ".join(f"{p} {row[path].get(p, 0):6.1f}" for p in PROJECTIONS),
                    flush=True,
                )
    return {"model": step.summary, "dtype": args.dtype, "rows": rows}


if __name__ == "__main__":
    run_main(main)
