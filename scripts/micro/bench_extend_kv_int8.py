#!/usr/bin/env python
"""Extend attention with bfloat16 queries over a bfloat16 pool and over an int8 pool, per layer.

One request of ``--new`` tokens over a ``--prefix`` cached (the tail of a long prompt's
prefill), pages shuffled; the two pools hold the same random K/V (int8: quantized per token
and head). CPU ms per layer (all threads), medians of ``--repeats`` passes, interleaved.
``--source DIR`` builds the kernels from another kernels/cpu folder (an older version, for an
A/B in separate processes).

    python scripts/micro/bench_extend_kv_int8.py --threads 2 --new 1024 --prefix 3072
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncengine.kernels.cpu import cpu_native  # noqa: E402
from asyncengine.kernels.cpu.attention_native import (  # noqa: E402
    native_extend_attention,
    plan_native_extend,
)
from asyncengine.kernels.reference.kv_int8_ref import quantize_kv  # noqa: E402
from asyncengine.script_main import run_main  # noqa: E402

PAGE = 16


def per_layer_ms(args: argparse.Namespace) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    depth = args.prefix + args.new
    pages = -(-depth // PAGE)
    table = torch.randperm(pages, generator=gen).to(torch.int32)[None, :]
    shape = (pages * PAGE, args.kv_heads, args.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(args.new, args.heads, args.head_dim, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, args.new], dtype=torch.int32)
    seq_lens = torch.tensor([depth], dtype=torch.int32)
    pools = {
        "bf16_pool": (k.to(torch.bfloat16), v.to(torch.bfloat16)),
        "int8_pool": (quantize_kv(k), quantize_kv(v)),
    }
    scale = args.head_dim**-0.5

    def layers(k_cache: torch.Tensor, v_cache: torch.Tensor) -> float:
        plan = plan_native_extend(table, cu, seq_lens, PAGE, args.heads, k_cache)
        assert plan is not None
        start = time.process_time()
        for _ in range(args.layers):
            native_extend_attention(q, k_cache, v_cache, plan, scale)
        return (time.process_time() - start) * 1e3 / args.layers

    for pool in pools.values():  # build and warm
        layers(*pool)
    times: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.repeats):
        for name, pool in pools.items():
            times[name].append(layers(*pool))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--source", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.source is not None:
        cpu_native.SOURCE_DIR = args.source.resolve()
    torch.set_num_threads(args.threads)
    result = per_layer_ms(args)
    result["int8_over_bf16"] = result["int8_pool"] / result["bf16_pool"]
    result["load"] = os.getloadavg()[0]
    print(json.dumps({k: round(x, 3) for k, x in result.items()}))
    return result


if __name__ == "__main__":
    run_main(main)
