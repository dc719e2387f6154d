"""The batch-1 product (one activation row, the decode GEMV) of Q5_0 weights in their own
interleaved groups against the same values as Q8_0 blocks (what the loader made of Q5_0 before
it had kernels: 34 bytes per 32 weights for 22), and Q5_1 and Q4_0 beside them, on the projection
shapes whose rows hold no whole 256-value super-block (Qwen2.5-0.5B's MLP, Gemma 3 1B's).

    python scripts/micro/bench_q5_gemv.py [--shapes 4864x896,6912x1152] [--repeats 400]
        [--threads 1]

Each shape is timed with its weights in cache (one copy) and from memory (a ring of copies of at
least --ring-mb, one call per copy); the formats alternate call by call, medians per format.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gguf import GGMLQuantizationType
from gguf.quants import quantize

from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.quant_formats import FORMATS, Q8_0, QuantizedTensor

TIMED = ("Q5_0", "Q8_0 (Q5_0's values)", "Q5_1", "Q4_0")


def q5_0_as_q8_0(weight: QuantizedTensor) -> QuantizedTensor:
    """Q5_0 blocks as Q8_0 blocks of exactly their values (the same d, each q - 16 an int8)."""
    blocks = weight.data.numpy().reshape(-1, 22)
    qh = blocks[:, 2:6].copy().view(np.uint32)[:, 0]
    qs = blocks[:, 6:22]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int16)
    high = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    values = (low | (high << 4)) - 16
    out = np.concatenate([blocks[:, :2], values.astype(np.int8).view(np.uint8)], axis=1)
    rows = weight.data.shape[0]
    return QuantizedTensor(Q8_0, torch.from_numpy(out.reshape(rows, -1).copy()), weight.cols)


def stored(name: str, dense: np.ndarray) -> QuantizedTensor:
    kind = GGMLQuantizationType[name]
    data = torch.from_numpy(quantize(dense, kind).copy()).reshape(dense.shape[0], -1)
    return QuantizedTensor(FORMATS[name], data, dense.shape[1])


def weights_of(rows: int, cols: int) -> dict[str, QuantizedTensor]:
    dense = (np.random.default_rng(rows).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    q5_0 = stored("Q5_0", dense)
    plain = {TIMED[0]: q5_0, TIMED[1]: q5_0_as_q8_0(q5_0)}
    plain.update({name: stored(name, dense) for name in TIMED[2:]})
    return {name: quant_native.interleave(w) for name, w in plain.items()}


def medians_us(
    rings: dict[str, list[QuantizedTensor]], x: torch.Tensor, repeats: int
) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in rings}
    for ring in rings.values():  # warm up (the library, the pages)
        for w in ring:
            quant_native.quant_linear(x, w)
    for i in range(repeats):
        for name, ring in rings.items():
            w = ring[i % len(ring)]
            start = time.perf_counter()
            quant_native.quant_linear(x, w)
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4864x896,6912x1152", help="rows x cols, ...")
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--ring-mb", type=int, default=256, help="bytes per format from memory")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels {quant_native.isa_name()}, threads {args.threads}, medians of {args.repeats}")
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        weights = weights_of(rows, cols)
        x = torch.randn(1, cols)
        for where in ("cache", "memory"):
            rings = {}
            for name, w in weights.items():
                copies = 1 if where == "cache" else -(-args.ring_mb * 2**20 // w.nbytes)
                rings[name] = [w] + [
                    QuantizedTensor(w.format, w.data.clone(), w.cols, w.interleaved)
                    for _ in range(copies - 1)
                ]
            us = medians_us(rings, x, args.repeats)
            base = us[TIMED[1]]
            for name in TIMED:
                nbytes = weights[name].nbytes
                print(
                    f"{rows}x{cols} {where:>6} {name:>22}: {us[name]:8.1f} us "
                    f"{nbytes / us[name] / 1e3:6.1f} GB/s  {base / us[name]:.2f}x Q8_0"
                )


if __name__ == "__main__":
    main()
