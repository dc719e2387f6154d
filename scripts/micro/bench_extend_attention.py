#!/usr/bin/env python
"""Extend (prefill) attention on the CPU: the native kernel against the torch path, per layer.

A prefill step of the offline mix attends a few thousand new tokens, ragged over tens of
requests, each over its own keys in a paged pool. Each ``--shapes`` entry is ``requests x new
tokens [+ cached prefix]``; the requests' lengths are spread around the given one (x0.5 ..
x1.5, fixed seed), pages shuffled. Both paths plan once per forward (as the model does, the
plan shared by the layers) and attend ``--layers`` times: ms per layer, medians of
``--repeats`` passes, interleaved. The outputs are compared (max abs difference).

    python scripts/micro/bench_extend_attention.py --threads 2 --json bench_results/extend_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncengine.kernels.cpu.attention_native import (  # noqa: E402
    extend_kernel_runs,
    native_extend_attention,
    plan_native_extend,
)
from asyncengine.kernels.reference.attention_ref import extend_attention_planned, plan_extend  # noqa: E402
from asyncengine.script_main import run_main  # noqa: E402

CPU_TIME = False  # --cpu-time: the process's CPU seconds (all threads), not wall


@dataclass
class Row:
    shape: str
    dtype: str
    tokens: int
    native_ms_per_layer: float
    torch_ms_per_layer: float
    speedup: float
    max_abs_diff: float


def _pool(
    q_lens: list[int], prefixes: list[int], heads: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens for these requests."""
    num_heads, num_kv_heads, head_dim = heads
    page = 16
    gen = torch.Generator().manual_seed(0)
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    pages = [-(-n // page) for n in seq_lens]
    order = torch.randperm(sum(pages), generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used : used + n]
        used += n
    slots = sum(pages) * page
    k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, cu, torch.tensor(seq_lens, dtype=torch.int32)


def _median_ms(fn: Callable[[], object], layers: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.process_time() if CPU_TIME else time.perf_counter()
        fn()
        end = time.process_time() if CPU_TIME else time.perf_counter()
        times.append((end - start) * 1e3 / layers)
    return times


def bench(shape: str, dtype: torch.dtype, args: argparse.Namespace) -> Row:
    requests, rest = shape.split("x")
    new, _, prefix = rest.partition("+")
    rng = np.random.default_rng(1)
    q_lens = [max(1, int(int(new) * f)) for f in rng.uniform(0.5, 1.5, int(requests))]
    prefixes = [int(prefix or 0)] * len(q_lens)
    heads = (args.heads, args.kv_heads, args.head_dim)
    q, kc, vc, table, cu, seq_lens = _pool(q_lens, prefixes, heads, dtype)
    scale = args.head_dim**-0.5

    def native() -> torch.Tensor:
        plan = plan_native_extend(table, cu, seq_lens, 16, args.heads, kc)
        assert plan is not None
        out = q
        for _ in range(args.layers):
            out = native_extend_attention(q, kc, vc, plan, scale)
        return out

    def reference() -> torch.Tensor:
        plan = plan_extend(table, cu, seq_lens, 16, args.heads, kc)
        out = q
        for _ in range(args.layers):
            out = extend_attention_planned(q, kc, vc, plan, scale)
        return out

    diff = float((native().float() - reference().float()).abs().max())
    native_ms: list[float] = []
    torch_ms: list[float] = []
    for _ in range(args.repeats):  # interleaved, so that load from elsewhere hits both
        native_ms += _median_ms(native, args.layers, 1)
        torch_ms += _median_ms(reference, args.layers, 1)
    n, t = statistics.median(native_ms), statistics.median(torch_ms)
    return Row(shape, str(dtype).removeprefix("torch."), int(cu[-1]), n, t, t / n, diff)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        default="25x160,8x512,4x160+512,64x1",
        help="requests x new tokens [+ cached prefix], comma separated",
    )
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time CPU seconds of the process (all threads) instead of wall: steadier on a "
        "loaded machine",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    global CPU_TIME
    CPU_TIME = args.cpu_time
    if not extend_kernel_runs():
        raise SystemExit("the native extend kernel does not run on this CPU")
    torch.set_num_threads(args.threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = [
        bench(shape, dtypes[d], args)
        for shape in args.shapes.split(",")
        for d in args.dtypes.split(",")
    ]
    clock = "CPU" if CPU_TIME else "wall"
    print(
        f"{clock} ms per layer, threads {args.threads}, load {[round(x, 2) for x in __import__('os').getloadavg()]}"
    )
    print(
        f"{'shape':<14}{'dtype':<10}{'tokens':>8}{'native ms':>11}{'torch ms':>10}{'ratio':>8}{'max diff':>10}"
    )
    for r in rows:
        print(f"{r.shape:<14}{r.dtype:<10}{r.tokens:>8}{r.native_ms_per_layer:>11.3f}"
              f"{r.torch_ms_per_layer:>10.3f}{r.speedup:>8.2f}{r.max_abs_diff:>10.1e}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return rows


if __name__ == "__main__":
    run_main(main)
