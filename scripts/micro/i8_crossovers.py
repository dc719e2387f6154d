"""bench_many_rows_step.py's ``--i8-crossovers``: per projection of a real shape's layer (and the
LM head), the K formats' and Q8_0's int8 product (kernels/cpu/cpu_quant_i8gemm.c) against the
dense product of the same weight (prepacked oneDNN; bfloat16, or float32 with ``--dtype
float32`` as on an AVX2 CPU, whose fast kernel takes the K formats) and, up to 64 rows, the quantized
group kernels; per row count, the medians of repeated calls, the paths alternating. Prints GMAC/s
of each and dense / int8 (> 1: the int8 product faster), where executor/layers/linear.py's
``I8_BELOW_ROWS_BY_FORMAT`` and ``I8_FROM_ROWS_BY_FORMAT`` come from. Run it with ``--threads 1
--cpu-time`` on a busy machine. Random blocks: a product's speed does not depend on the values."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from bench_quant_matmul import SHAPES, random_blocks

from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.kernels.cpu import quant_i8gemm_native, quant_native

GROUP_UP_TO = 64  # rows up to which the group kernels are timed too


def run_i8_crossovers(args: argparse.Namespace) -> dict[str, Any]:
    formats = args.i8_crossovers.split(",")
    if not quant_i8gemm_native.available(formats=formats):
        raise SystemExit(f"no fast int8 product of {', '.join(formats)} on this CPU")
    dtype = getattr(torch, args.dtype)
    clock: Callable[[], float] = time.process_time if args.cpu_time else time.perf_counter
    layer, head = SHAPES[args.shape]
    results = []
    print(
        f"{args.shape}; threads {torch.get_num_threads()}; {args.dtype}; GMAC/s, "
        "dense / int8 (> 1: int8 faster)"
    )
    with torch.inference_mode():
        for fmt in formats:
            for name, out, inp in [*layer, head]:
                linear = QuantizedLinear([random_blocks(fmt, out, inp)], None, 1)
                part = linear.parts[0]
                dense = linear.dense(dtype)
                panels = quant_i8gemm_native.pack(part)
                for n in args.batches:
                    x = torch.randn(n, inp).to(dtype)
                    paths: dict[str, Callable[[], Any]] = {
                        "int8": partial(quant_i8gemm_native.linear, x, panels),
                        "dense": partial(dense, x),
                    }
                    if n <= GROUP_UP_TO:
                        paths["group"] = partial(quant_native.quant_linear, x, part)
                    times: dict[str, list[float]] = {path: [] for path in paths}
                    for repeat in range(args.repeats + 1):
                        for path, call in paths.items():
                            start = clock()
                            call()
                            if repeat:
                                times[path].append(clock() - start)
                    ms = {path: statistics.median(t) * 1e3 for path, t in times.items()}
                    gmac = n * out * inp / 1e6
                    row = {
                        "format": fmt,
                        "projection": name,
                        "rows": n,
                        **{f"{p}_ms": v for p, v in ms.items()},
                    }
                    results.append(row)
                    print(
                        f"{fmt} {name:8s} {n:4d} rows: "
                        + "  ".join(f"{path} {gmac / v:6.1f}" for path, v in ms.items())
                        + f"  dense/int8 {ms['dense'] / ms['int8']:4.2f}"
                        + (
                            f"  group/int8 {ms['group'] / ms['int8']:4.2f}" if "group" in ms else ""
                        ),
                        flush=True,
                    )
    return {"shape": args.shape, "rows": results}
