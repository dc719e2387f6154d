"""bench_many_rows_step.py's ``--vs-expanded`` mode: a GGUF kept quantized against the same file
expanded to bfloat16, per batch size and for a prefill, alternating in one process."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader.gguf_loader import Weight
from asyncengine.executor.loader.quantized import load_model
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.quant_formats import QuantizedTensor

PAGE = 16
PATHS = ("quantized", "expanded")


def expanded(weights: dict[str, Weight]) -> dict[str, Weight]:
    """Every quantized weight dequantized to dense bfloat16 (the weights ``quantization none``
    loads from the same file, without writing its converted directory)."""
    return {
        name: quant_native.dequantize_rows(w, None, torch.bfloat16)
        if isinstance(w, QuantizedTensor)
        else w
        for name, w in weights.items()
    }


def page_table(rows: int, decode_pages: int, prefill_pages: int) -> PageTable:
    """Row 0 long enough for the prefill, every row its own run of pages for a decode."""
    table = PageTable(rows, max(decode_pages, prefill_pages))
    table.set_pages(0, 0, list(range(max(decode_pages, prefill_pages))))
    first = max(decode_pages, prefill_pages)
    for row in range(1, rows):
        table.set_pages(row, 0, list(range(first, first + decode_pages)))
        first += decode_pages
    return table


def one_model(path: str, args: argparse.Namespace) -> dict[str, Any]:
    dtype = torch.bfloat16
    loaded = load_model(path, dtype, torch.device("cpu"), "auto")
    config = ModelConfig.from_hf_dict(json.loads((loaded.model_dir / "config.json").read_text()))
    rows = max(args.batches)
    decode_pages = -(-(args.context + 2) // PAGE)
    prefill_pages = -(-args.prefill // PAGE)
    pages = max(decode_pages, prefill_pages) + (rows - 1) * decode_pages
    pool = KVPool.for_model(config, pages, PAGE, dtype)
    pool.k.uniform_(-1, 1)
    pool.v.uniform_(-1, 1)
    kept = loaded.summary()
    start = time.perf_counter()
    dense = expanded(loaded.weights)
    expand_s = time.perf_counter() - start
    runners = {
        "quantized": ModelRunner(
            config, dict(loaded.weights), pool, page_table(rows, decode_pages, prefill_pages), dtype
        ),
        "expanded": ModelRunner(
            config, dense, pool, page_table(rows, decode_pages, prefill_pages), dtype
        ),
    }
    del dense, loaded
    plans: list[tuple[str, int, BatchPlan]] = [
        (
            f"decode B={batch}",
            batch,
            BatchPlan(
                step=0,
                decodes=[Segment(f"r{b}", b, [100 + b], args.context, True) for b in range(batch)],
            ),
        )
        for batch in args.batches
    ]
    prompt = [int(t) for t in torch.randint(0, config.vocab_size, (args.prefill,))]
    plans.append(
        (
            f"prefill {args.prefill}",
            args.prefill,
            BatchPlan(step=0, extends=[Segment("p", 0, prompt, 0, True)]),
        )
    )
    clock = time.process_time if args.cpu_time else time.perf_counter
    cells = []
    for name, tokens, plan in plans:
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for repeat in range(args.repeats + 1):
            for side in PATHS if repeat % 2 == 0 else reversed(PATHS):
                begin = clock()
                runners[side].forward_logits(plan)
                if repeat:  # the first round warms up (and builds any dense copies)
                    times[side].append(clock() - begin)
        tok_s = {p: tokens / statistics.median(t) for p, t in times.items()}
        ratio = tok_s["quantized"] / tok_s["expanded"]
        cells.append(
            {
                "cell": name,
                "tokens": tokens,
                **{f"{p}_tok_s": v for p, v in tok_s.items()},
                "ratio": ratio,
            }
        )
        print(
            f"  {name:14s} quantized {tok_s['quantized']:8.1f} tok/s  expanded "
            f"{tok_s['expanded']:8.1f} tok/s  ratio {ratio:5.2f}{'  <1' if ratio < 1 else ''}",
            flush=True,
        )
    return {"model": Path(path).name, "kept": kept, "expand_s": expand_s, "cells": cells}


def run_vs_expanded(models: list[str], args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    print(
        f"threads {torch.get_num_threads()}; clock {'CPU' if args.cpu_time else 'wall'}; "
        f"context {args.context}; repeats {args.repeats}"
    )
    results = []
    with torch.inference_mode():
        for path in models:
            print(Path(path).name, flush=True)
            results.append(one_model(str(Path(path).expanduser()), args))
    names = [c["cell"] for c in results[0]["cells"]]
    print("\nquantized / expanded-to-bfloat16 tok/s (< 1: slower than the expansion)")
    print(f"{'format':28s}" + "".join(f"{n:>16s}" for n in names))
    for result in results:
        print(f"{result['model']:28s}" + "".join(f"{c['ratio']:16.2f}" for c in result["cells"]))
    out = {"threads": torch.get_num_threads(), "cpu_time": args.cpu_time, "context": args.context,
           "repeats": args.repeats,
           "wall_s": time.perf_counter() - start, "models": results}  # fmt: skip
    print(f"wall {out['wall_s']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out
