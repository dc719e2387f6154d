#!/usr/bin/env python
"""What copying a request's KV back from the host tier costs, against its floor and the options.

For ``--pages`` pages of the embedded model's shape (30 layers, 3 KV heads, head dim 64, a page
of 16 tokens, ``--dtype``), consecutive (as a request's pages mostly are) and scattered, the
median milliseconds (wall and this process's CPU time, which other load on the machine moves
less) of:

- ``runs``: the executor's copy (``HostKVBuffer.run``: runs of consecutive pages, a native
  memcpy per run and layer, kernels/cpu/cpu_page_copy.c);
- ``torch runs``: the same runs as torch slice copies (the path without a C compiler);
- ``indexed``: the same copy with page lists (``pool[:, dst] = host[:, src]``: gather, scatter);
- ``memcpy``: one contiguous copy of the same bytes (the floor);
- ``int8 store``/``int8 load``: a quantized host copy (int8 per token and head, a float32
  scale each; what would halve a bfloat16 host tier): quantizing the pages on the way out,
  dequantizing them on the way back (the copy itself not counted).

    .venv/bin/python scripts/micro/bench_host_copy.py [--pages 64] [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from asyncengine.common.plan import SwapCopy
from asyncengine.executor.host_kv_buffer import HostKVBuffer, page_runs
from asyncengine.executor.kv_pool import KVPool
from asyncengine.kernels.cpu.page_copy_native import copy_page_runs_ref
from asyncengine.script_main import run_main


def timed(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``run`` (one call first, off the clock)."""
    run()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=64, help="a 1,000-token history: 64")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    n = args.pages
    pool = KVPool(30, 3, 64, 6 * n, 16, dtype)
    pool.k.normal_()
    pool.v.normal_()
    host = HostKVBuffer(pool, 8 * n)
    host.k.normal_()
    host.v.normal_()
    nbytes = n * pool.bytes_per_token * pool.page_size
    generator = torch.Generator().manual_seed(0)
    layouts = {
        "consecutive": (list(range(3 * n, 4 * n)), list(range(n, 2 * n))),
        "scattered": (
            torch.randperm(8 * n, generator=generator)[:n].tolist(),
            torch.randperm(6 * n, generator=generator)[:n].tolist(),
        ),
    }
    print(
        f"{n} pages ({nbytes / 2**20:.1f} MiB of K and V, {args.dtype}), {args.threads} "
        f"threads, load average {os.getloadavg()[0]:.1f}; median ms, wall / CPU"
    )
    pool_k, pool_v = host._pages(pool.k), host._pages(pool.v)
    host_k, host_v = host._pages(host.k), host._pages(host.v)
    for name, (host_pages, pool_pages) in layouts.items():
        src, dst = torch.tensor(host_pages), torch.tensor(pool_pages)
        copy = [SwapCopy(pool_pages, host_pages)]

        def indexed(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
            pool_k[:, dst] = host_k[:, src]
            pool_v[:, dst] = host_v[:, src]

        def torch_runs(
            runs: list[tuple[int, int, int]] = page_runs([host_pages], [pool_pages]),
        ) -> None:
            copy_page_runs_ref(pool_k, host_k, runs)
            copy_page_runs_ref(pool_v, host_v, runs)

        runs = timed(lambda copy=copy: host.run([], copy), args.repeats)  # type: ignore[misc]
        plain = timed(torch_runs, args.repeats)
        index = timed(indexed, args.repeats)
        print(
            f"  {name:<11} runs {runs[0]:7.2f} / {runs[1]:7.2f}   "
            f"torch runs {plain[0]:7.2f} / {plain[1]:7.2f}   "
            f"indexed {index[0]:7.2f} / {index[1]:7.2f}   ({nbytes / runs[0] / 1e6:.2f} GB/s)"
        )
    flat = torch.ones(nbytes // dtype.itemsize, dtype=dtype)
    target = torch.zeros_like(flat)
    floor = timed(lambda: target.copy_(flat), args.repeats)
    print(f"  memcpy floor {floor[0]:7.2f} / {floor[1]:7.2f}")
    pages = torch.cat([host_k[:, :n], host_v[:, :n]])

    def quantize() -> tuple[torch.Tensor, torch.Tensor]:
        scale = pages.abs().amax(-1, keepdim=True).float().clamp_min(1e-8) / 127
        return (pages.float() / scale).round().to(torch.int8), scale

    quantized, scale = quantize()
    store = timed(quantize, args.repeats)
    load = timed(lambda: (quantized.float() * scale).to(dtype), args.repeats)
    error = ((quantized.float() * scale) - pages.float()).abs().max().item()
    ratio = nbytes / (quantized.numel() + scale.numel() * 4)
    print(
        f"  int8 store {store[0]:7.2f} / {store[1]:7.2f}   int8 load {load[0]:7.2f} / "
        f"{load[1]:7.2f}   ({ratio:.2f}x fewer bytes, largest error {error:.3g})"
    )


if __name__ == "__main__":
    run_main(main)
