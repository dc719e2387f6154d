#!/usr/bin/env python
"""Measure LoRA's compute and adapter loads on this machine and fit the simulator's LoRA costs.

    python scripts/fit_lora_cost.py --out asyncengine/sim/default_lora_cost_model.json
    python scripts/fit_lora_cost.py --quick --out lora_cost.json

Compute: for each (rank, rows, adapters) of a grid, the segmented shrink-then-expand of every
target module of the embedded model's shape (asyncengine/sim/lora_cost.py ``LoraShape``):
rows split evenly among the adapters, each segment ``x @ A.T @ B.T`` with its own adapter's
weights, in bfloat16 on ``--threads`` threads, as the batched LoRA forward computes it; the
median of ``--repeats`` runs of one layer, times the layers, is the sample. Loads: adapter
files of each rank written to ``--dir`` and read back (``os.posix_fadvise`` drops them from the
page cache first where the system has it, so the read is the disk's). The fit is non-negative
least squares on relative error (``LoraCostModel.fit``); the script prints measured against
predicted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncengine.script_main import run_main
from asyncengine.sim.lora_cost import LoraCostModel, LoraShape


def time_compute(shape: LoraShape, rank: int, rows: int, adapters: int, repeats: int) -> float:
    """Seconds for one step's LoRA over ``rows`` rows of ``adapters`` adapters, all layers."""
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(rank * 1000 + rows + adapters)
    weights = [
        [
            (
                torch.randn(rank, n_in, generator=generator, dtype=dtype),
                torch.randn(n_out, rank, generator=generator, dtype=dtype),
            )
            for _, n_in, n_out in shape.modules
        ]
        for _ in range(adapters)
    ]
    inputs = [
        torch.randn(rows, n_in, generator=generator, dtype=dtype) for _, n_in, _ in shape.modules
    ]
    bounds = [rows * i // adapters for i in range(adapters + 1)]

    def one_layer() -> None:
        for m, x in enumerate(inputs):
            for a in range(adapters):
                segment = x[bounds[a] : bounds[a + 1]]
                if segment.shape[0]:
                    shrink, expand = weights[a][m]
                    (segment @ shrink.T) @ expand.T

    one_layer()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_layer()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * shape.num_layers


def time_load(path: Path, nbytes: int) -> float:
    """Seconds to read an adapter file of ``nbytes`` into a tensor, from disk where possible."""
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        data = bytearray()
        while chunk := os.read(fd, 1 << 20):
            data += chunk
        torch.frombuffer(data, dtype=torch.bfloat16).clone()
        return time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()


def main(argv: Sequence[str] | None = None) -> LoraCostModel:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--dir", default=None, help="where the adapter files are written")
    parser.add_argument("--out", required=True, help="LoRA cost model JSON to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = LoraShape()
    ranks = (8, 64) if args.quick else (8, 16, 32, 64)
    row_counts = (1, 64, 512) if args.quick else (1, 8, 64, 256, 1024)
    adapter_counts = (1, 4) if args.quick else (1, 2, 4, 8)
    compute: list[tuple[int, int, int, float]] = []
    for rank in ranks:
        for rows in row_counts:
            for adapters in adapter_counts:
                if adapters > rows:
                    continue
                seconds = time_compute(shape, rank, rows, adapters, args.repeats)
                flops = rows * shape.flops_per_row(rank)
                compute.append((flops, adapters * shape.adapter_bytes(rank), adapters, seconds))
    loads: list[tuple[int, float]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for rank in ranks:
            nbytes = shape.adapter_bytes(rank)
            for i in range(3):
                loads.append((nbytes, time_load(Path(folder) / f"adapter{rank}_{i}.bin", nbytes)))
    description = (
        f"fitted: LoRA of rank {ranks[0]}-{ranks[-1]} over SmolLM2-135M's shape, torch bfloat16 "
        f"segments on {args.threads} thread(s), {platform.machine()}; "
        f"{len(compute)} steps, {len(loads)} loads"
    )
    model = LoraCostModel.fit(compute, loads, description)
    for flops, weight, adapters, seconds in compute:
        predicted = model.compute_seconds(flops, weight, adapters)
        print(f"flops {flops:>13,} adapters {adapters}: {seconds * 1e3:8.2f} ms measured, "
              f"{predicted * 1e3:8.2f} ms predicted")  # fmt: skip
    for nbytes, seconds in loads:
        print(f"load {nbytes:>11,} B: {seconds * 1e3:8.2f} ms measured, "
              f"{model.load_seconds(nbytes) * 1e3:8.2f} ms predicted")  # fmt: skip
    model.save(args.out)
    print(f"wrote {args.out}: {model}")
    return model


if __name__ == "__main__":
    run_main(main)
