#!/usr/bin/env python
"""Fit the prices the torch backend uses to cut extends into buckets (``ExtendCost``).

Times one bucketed extend attention call (gather + fused attention + copies, one layer) over a
grid of [requests, query length, cached prefix] shapes with the model's head sizes, and fits
``time = pair * n*q*L + key * n*L + request * n + call`` by least squares on relative error.
The per-request term is the same for any bucketing of a step, so only pair, key and call enter
``kernels/attention_grouping.extend_cost_for``; the script prints them and the values that
function gives now, to compare.

    .venv/bin/python scripts/fit_extend_cost.py --threads 1   # CPU time: run it on one thread
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import DEFAULT_MODEL, load_hf_config, resolve_model
from asyncengine.kernels.attention_grouping import ExtendCost, extend_cost_for
from asyncengine.kernels.reference.attention_ref import extend_attention_planned, plan_extend
from asyncengine.script_main import run_main

# (requests, query length, cached prefix)
GRID = [
    (1, 1, 0), (1, 8, 0), (1, 32, 0), (1, 64, 0), (1, 128, 0), (1, 256, 0), (1, 512, 0),
    (2, 256, 0), (4, 32, 0), (4, 128, 0), (8, 64, 0), (16, 16, 0), (32, 8, 0),
    (1, 16, 256), (4, 16, 256), (8, 4, 512),
]  # fmt: skip
ONE_BUCKET = ExtendCost(pair=1.0, key=1.0, call=float("inf"))


def time_bucket(
    config: ModelConfig, shape: tuple[int, int, int], page_size: int, repeats: int
) -> float:
    requests, q_len, prefix = shape
    kv_len = q_len + prefix
    pages = -(-kv_len // page_size)
    kv_shape = (requests * pages * page_size, config.num_kv_heads, config.head_dim)
    k_cache, v_cache = torch.randn(kv_shape), torch.randn(kv_shape)
    block_table = torch.randperm(requests * pages).view(requests, pages).int()
    seq_lens = torch.full((requests,), kv_len, dtype=torch.int32)
    cu = torch.arange(0, requests * q_len + 1, q_len, dtype=torch.int32)
    q = torch.randn(requests * q_len, config.num_heads, config.head_dim)
    plan = plan_extend(block_table, cu, seq_lens, page_size, config.num_heads, k_cache, ONE_BUCKET)
    samples = []
    for _ in range(repeats + 1):
        start = time.process_time()
        extend_attention_planned(q, k_cache, v_cache, plan, config.head_dim**-0.5)
        samples.append(time.process_time() - start)
    return statistics.median(samples[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or HF directory")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig.from_hf_dict(load_hf_config(resolve_model(args.model, torch.float32)))
    features, seconds = [], []
    for shape in GRID:
        n, q_len, prefix = shape
        features.append([n * q_len * (q_len + prefix), n * (q_len + prefix), n, 1.0])
        seconds.append(time_bucket(config, shape, args.page_size, args.repeats))
    x, y = np.asarray(features), np.asarray(seconds)
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    print(f"{'requests':>8} {'q':>5} {'prefix':>6} {'measured us':>12} {'fitted us':>10}")
    for shape, measured, fitted in zip(GRID, y, x @ coef, strict=True):
        print(
            f"{shape[0]:>8} {shape[1]:>5} {shape[2]:>6} {measured * 1e6:>12.0f} {fitted * 1e6:>10.0f}"
        )
    pair, key, request, call = coef
    now = extend_cost_for(config.num_heads, config.num_kv_heads, config.head_dim)
    print(
        f"\nfitted  pair {pair:.3g} s  key {key:.3g} s  call {call:.3g} s  (request {request:.3g} s)"
    )
    print(f"in use  pair {now.pair:.3g} s  key {now.key:.3g} s  call {now.call:.3g} s")
    print(f"{torch.get_num_threads()} threads, heads {config.num_heads} x {config.head_dim}, "
          f"kv heads {config.num_kv_heads}")  # fmt: skip


if __name__ == "__main__":
    run_main(main)
