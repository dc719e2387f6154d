"""bench_many_rows_step.py's ``--amx-vs-dense`` mode: per projection of a real shape's layer
(and the LM head), a GGUF block format's AMX product against the dense bfloat16 product of the same
weight (prepacked oneDNN: what a projection without the AMX product takes past its crossover) or,
with ``--amx-against i8``, its int8 product (what it takes below ``AMX_FROM_ROWS_BY_FORMAT``),
per row count; the medians of repeated calls, the two alternating. Random blocks: a product's
speed does not depend on the values. Run it with ``--threads 1 --cpu-time`` on a busy
machine."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_quant_matmul import SHAPES, random_blocks

from asyncengine.executor.layers.linear import QuantizedLinear


def run_amx_vs_dense(args: argparse.Namespace) -> dict[str, Any]:
    clock: Callable[[], float] = time.process_time if args.cpu_time else time.perf_counter
    layer, head = SHAPES[args.shape]
    rows_list = args.batches
    results = []
    against = args.amx_against
    print(f"{args.shape}; threads {torch.get_num_threads()}; amx / {against} ms (< 1: AMX faster)")
    with torch.inference_mode():
        for fmt in args.amx_vs_dense.split(","):
            for name, out, inp in [*layer, head]:
                linear = QuantizedLinear([random_blocks(fmt, out, inp)], None, 1)
                if not linear._amx:
                    raise SystemExit(f"{fmt}: no AMX product on this CPU")
                if against == "i8":
                    if not linear._finish_i8():
                        raise SystemExit(f"{fmt}: no int8 product on this CPU")
                    other: Callable[[torch.Tensor], torch.Tensor] = linear._i8_product
                else:
                    other = linear.dense(torch.bfloat16)
                ratios = []
                for n in rows_list:
                    x = torch.randn(n, inp).to(torch.bfloat16)
                    times: dict[str, list[float]] = {"amx": [], against: []}
                    for repeat in range(args.repeats + 1):
                        for path in times:
                            start = clock()
                            if path == "amx":
                                linear._amx_product(x)
                            else:
                                other(x)
                            if repeat:
                                times[path].append(clock() - start)
                    amx, other_ms = (statistics.median(times[p]) * 1e3 for p in ("amx", against))
                    ratios.append(amx / other_ms)
                    results.append(
                        {
                            "format": fmt,
                            "projection": name,
                            "rows": n,
                            "amx_ms": amx,
                            f"{against}_ms": other_ms,
                        }  # fmt: skip
                    )
                print(
                    f"{fmt} {name:8s} "
                    + " ".join(f"{n}: {r:4.2f}" for n, r in zip(rows_list, ratios, strict=True)),
                    flush=True,
                )
    return {"shape": args.shape, "rows": results}
