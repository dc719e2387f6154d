#!/usr/bin/env python
"""Copy bandwidth of KV swaps (preemption_mode "swap"): pool pages to the host buffer and back.

Runs the executor's own copy (``HostKVBuffer.run``) for a victim of ``--pages`` pages of the
embedded model's shape (30 layers, 3 KV heads, head dim 64; float32 on a CPU, bfloat16 on a
GPU where the host buffer is pinned), ``--repeats`` times each way, and prints the median
bytes per second. The simulator charges a swap its bytes over this figure
(``DEFAULT_SWAP_BYTES_PER_SECOND`` in asyncengine/sim/simulated_executor.py).

    python scripts/micro/bench_swap.py [--device cpu|cuda] [--pages 64 256] [--out bench_results/bench_swap.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from asyncengine.common.plan import SwapCopy
from asyncengine.executor.host_kv_buffer import HostKVBuffer
from asyncengine.executor.kv_pool import KVPool
from asyncengine.script_main import run_main


def measure(device: str, pages: int, repeats: int, page_size: int = 16) -> dict[str, float]:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    pool = KVPool(30, 3, 64, 4 * pages, page_size, dtype, device)
    pool.k.normal_()
    pool.v.normal_()
    host = HostKVBuffer(pool, 2 * pages)
    page_bytes = pool.bytes_per_token * page_size
    # scattered pages, as a pool that has been in use hands them out
    pool_pages = torch.randperm(4 * pages)[:pages].tolist()
    host_pages = torch.randperm(2 * pages)[:pages].tolist()
    copy = [SwapCopy(pool_pages, host_pages)]
    host.run(copy, [])  # first touch of the host pages, off the clock
    outs = [host.run(copy, []) for _ in range(repeats)]
    ins = [host.run([], copy) for _ in range(repeats)]
    nbytes = pages * page_bytes
    return {
        "pages": pages,
        "bytes": nbytes,
        "out_bytes_per_second": nbytes / statistics.median(outs),
        "in_bytes_per_second": nbytes / statistics.median(ins),
    }


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pages", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="bench_results/bench_swap.json")
    args = parser.parse_args(argv)
    rows = [measure(args.device, n, args.repeats) for n in args.pages]
    print(f"device {args.device}, load average {os.getloadavg()[0]:.2f}")
    print("| pages | MB | out GB/s | in GB/s |\n| ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['pages']} | {row['bytes'] / 1e6:.1f} | "
            f"{row['out_bytes_per_second'] / 1e9:.2f} | {row['in_bytes_per_second'] / 1e9:.2f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    run_main(main)
