"""The int8 product (kernels/cpu/cpu_quant_i8gemm.c) of this tree against another build of it
(``--baseline-library``, a .so of the same C entry points: e.g. the main branch's source compiled
with cpu_native's flags), per projection of a real shape's layer (q/k/v also apart: a
Q4_K_M model's attn_v is Q6_K) and its LM head, at each of ``--rows``: the two alternating call
by call, medians of ``--repeats``. Prints each build's GMAC/s, and with ``--peak`` (GMAC/s of a
bare vpdpbusd loop on one core: 64 x its instructions a second) the fraction of it per thread.
Each build packs its own panels; the largest difference of their outputs is printed.
Random blocks: a product's speed does not depend on the values. On a loaded machine
``--threads 1 --cpu-time`` counts the calling thread's CPU time (the product runs on it alone),
which other processes disturb far less than wall time.

    git show main:kernels/cpu/cpu_quant_i8gemm.c > /tmp/i8_main.c
    cc -O3 -march=native -fopenmp -shared -fPIC -std=c11 -Ikernels/cpu /tmp/i8_main.c \\
        -o /tmp/i8_main.so -lm
    .venv/bin/python scripts/micro/bench_i8_ab.py --baseline-library /tmp/i8_main.so \\
        --shape qwen2.5-1.5b --formats Q4_K,Q6_K,Q8_0 --rows 32,1024
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/micro: bench_quant_matmul

import torch
from bench_quant_matmul import SHAPES, random_blocks

from asyncengine.kernels.cpu import cpu_native, quant_native
from asyncengine.kernels.quant_formats import QuantizedTensor
from asyncengine.script_main import run_main

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The entry points this script calls, with their C types."""
    lib.asyncengine_i8_panel_bytes.restype = _I64
    lib.asyncengine_i8_panel_bytes.argtypes = [_INT, _I64]
    lib.asyncengine_i8_pack.restype = None
    lib.asyncengine_i8_pack.argtypes = [_INT, _PTR, _I64, _I64, _I64, _INT, _PTR, _INT]
    lib.asyncengine_i8_linear.restype = _INT
    lib.asyncengine_i8_linear.argtypes = [
        _INT, _PTR, _I64, _I64, _PTR, _I64, _INT, _PTR, _PTR, _I64, _INT, _INT
    ]  # fmt: skip
    return lib


def pack(lib: ctypes.CDLL, weight: QuantizedTensor, threads: int) -> torch.Tensor:
    rows, cols = weight.shape
    panel_bytes = int(lib.asyncengine_i8_panel_bytes(weight.format.code, cols))
    out = torch.empty((-(-rows // 16), panel_bytes), dtype=torch.uint8)
    data = weight.data.contiguous()
    lib.asyncengine_i8_pack(
        weight.format.code, data.data_ptr(), data.shape[1], rows, cols,
        int(weight.interleaved), out.data_ptr(), threads,
    )  # fmt: skip
    return out


def linear(
    lib: ctypes.CDLL, code: int, panels: torch.Tensor, x: torch.Tensor, y: torch.Tensor, t: int
) -> None:
    n, cols = x.shape
    status = lib.asyncengine_i8_linear(
        code, panels.data_ptr(), y.shape[1], cols, x.data_ptr(), n, 1, None, y.data_ptr(),
        y.shape[1], 1, t,
    )  # fmt: skip
    if status != 0:
        raise MemoryError("no activation buffers")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-library", required=True, help="a .so of cpu_quant_i8gemm.c")
    parser.add_argument("--library", default=None, help="a .so in place of this tree's build")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--formats", default="Q4_K,Q6_K,Q8_0")
    parser.add_argument("--rows", default="32", help="activation rows, comma-separated")
    parser.add_argument("--only", default="", help="projections, comma-separated (all: empty)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak", type=float, default=0.0, help="bare vpdpbusd GMAC/s, a core")
    parser.add_argument("--out", default=None, help="JSON here")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --threads 1: this thread's CPU time, not wall time (a loaded machine)",
    )
    args = parser.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1 (other threads' time is not counted)")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    ours_lib = ctypes.CDLL(args.library) if args.library else cpu_native.load("cpu_quant_i8gemm")
    if ours_lib is None:
        raise SystemExit("the int8 product did not build")
    libs = {"ours": declared(ours_lib), "base": declared(ctypes.CDLL(args.baseline_library))}
    layer, head = SHAPES[args.shape]
    _, qkv_rows, hidden = layer[0]  # q's rows are the hidden size in these shapes
    apart = [("q_proj", hidden, hidden), ("kv_proj", (qkv_rows - hidden) // 2, hidden)]
    shapes = [*layer, *apart, head]
    if args.only:
        shapes = [s for s in shapes if s[0] in args.only.split(",")]
    results = []
    timing = "CPU time" if args.cpu_time else "wall time"
    print(f"{args.shape}; threads {args.threads}; {timing}; GMAC/s (fraction of bare vpdpbusd)")
    with torch.inference_mode():
        for fmt in args.formats.split(","):
            for name, out_rows, cols in shapes:
                weight = quant_native.interleave(random_blocks(fmt, out_rows, cols))
                panels = {p: pack(lib, weight, args.threads) for p, lib in libs.items()}
                for n in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(n, cols).to(torch.bfloat16)
                    outs = {p: torch.empty(n, out_rows, dtype=torch.bfloat16) for p in libs}
                    times: dict[str, list[float]] = {p: [] for p in libs}
                    for repeat in range(args.repeats + 1):
                        for p, lib in libs.items():
                            start = clock()
                            linear(lib, weight.format.code, panels[p], x, outs[p], args.threads)
                            if repeat:  # the first round warms up
                                times[p].append(clock() - start)
                    ref = outs["base"].float()
                    err = float((outs["ours"].float() - ref).abs().max() / ref.abs().max())
                    ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
                    gmac = n * out_rows * cols / 1e6
                    peak = args.peak * args.threads
                    frac = {p: gmac / v / peak if peak else 0.0 for p, v in ms.items()}
                    results.append(
                        {"format": fmt, "projection": name, "rows": n, "ours_ms": ms["ours"],
                         "baseline_ms": ms["base"], "max_rel_diff": err}
                    )  # fmt: skip
                    print(
                        f"{fmt} {name:8s} {out_rows:6d}x{cols:<5d} n={n:4d} "
                        f"ours {gmac / ms['ours']:6.1f} ({frac['ours']:.2f})  "
                        f"base {gmac / ms['base']:6.1f} ({frac['base']:.2f})  "
                        f"base/ours {ms['base'] / ms['ours']:4.2f}  diff {err:.1e}",
                        flush=True,
                    )
    result = {"shape": args.shape, "threads": args.threads, "rows": results}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    run_main(main)
