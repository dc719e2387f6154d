"""The K formats' AMX product (kernels/cpu/cpu_quant_amx.c) of this tree against another build
of it (``--baseline-library``, a .so of the same C entry point: e.g. the main branch's source
compiled with cpu_native's flags), per projection of a real shape's layer and its LM head, at
each of ``--rows``: the two alternating call by call, medians of ``--repeats``, this process's
CPU time (``--threads 1`` on a busy machine). Both must give the same bits (checked). Random
blocks: a product's speed does not depend on the values.

    git show main:kernels/cpu/cpu_quant_amx.c > /tmp/amx_main.c
    cc -O3 -march=native -fopenmp -shared -fPIC -std=c11 -Ikernels/cpu /tmp/amx_main.c \\
        -o /tmp/amx_main.so
    .venv/bin/python scripts/micro/bench_amx_ab.py --baseline-library /tmp/amx_main.so \\
        --shape qwen2.5-1.5b --formats Q4_K,Q6_K --rows 16,32
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/micro: bench_quant_matmul

import torch
from bench_quant_matmul import SHAPES, random_blocks

from asyncengine.kernels.cpu import quant_amx_native, quant_native
from asyncengine.script_main import run_main


def baseline_library(path: str) -> ctypes.CDLL:
    """Another build of cpu_quant_amx.c, declared as the engine's (quant_amx_native)."""
    lib = quant_amx_native.declared(ctypes.CDLL(path))
    if lib is None:
        raise SystemExit(f"{path}: no AMX product here")
    return lib


@contextlib.contextmanager
def using(lib: ctypes.CDLL | None) -> Iterator[None]:
    """quant_amx_native's products on ``lib`` meanwhile (None: the engine's own build)."""
    if lib is None:
        yield
        return
    own = quant_amx_native._library
    quant_amx_native._library = lambda: lib  # type: ignore[assignment]
    try:
        yield
    finally:
        quant_amx_native._library = own


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-library", required=True, help="a .so of cpu_quant_amx.c")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--formats", default="Q4_K,Q6_K")
    parser.add_argument("--rows", default="32", help="activation rows, comma-separated")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not quant_amx_native.available():
        raise SystemExit("no AMX product on this CPU")
    baseline = baseline_library(args.baseline_library)
    layer, head = SHAPES[args.shape]
    results = []
    print(f"{args.shape}; threads {args.threads}; CPU ms, this tree / baseline (< 1: faster)")
    with torch.inference_mode():
        for fmt in args.formats.split(","):
            for name, out_rows, cols in [*layer, head]:
                weight = quant_native.interleave(random_blocks(fmt, out_rows, cols))
                for n in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(n, cols).to(torch.bfloat16)
                    ours_out = torch.empty(n, out_rows, dtype=torch.bfloat16)
                    base_out = torch.empty(n, out_rows, dtype=torch.bfloat16)
                    times: dict[str, list[float]] = {"ours": [], "baseline": []}
                    for repeat in range(args.repeats + 1):
                        for path in times:
                            start = time.process_time()
                            with using(baseline if path == "baseline" else None):
                                quant_amx_native.linear(
                                    x, weight, None, ours_out if path == "ours" else base_out
                                )
                            if repeat:  # the first round warms up
                                times[path].append(time.process_time() - start)
                    if not torch.equal(ours_out, base_out):
                        raise SystemExit(f"{fmt} {name} at {n} rows: the two builds differ")
                    ours, base = (statistics.median(times[p]) * 1e3 for p in ("ours", "baseline"))
                    results.append(
                        {"format": fmt, "projection": name, "rows": n, "ours_ms": ours,
                         "baseline_ms": base}
                    )  # fmt: skip
                    print(
                        f"{fmt} {name:8s} {out_rows:6d}x{cols:<5d} n={n:3d} "
                        f"ours {ours:7.2f}  baseline {base:7.2f}  ratio {ours / base:4.2f}",
                        flush=True,
                    )
    result = {"shape": args.shape, "threads": args.threads, "rows": results}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    run_main(main)
