#!/usr/bin/env python
"""Multi-LoRA serving cost, in one run: ratios of medians, so machine speed cancels out.

1. Mix vs base: ``--requests`` requests of ``--prompt-len`` random tokens and ``--output-len``
   greedy tokens (EOS ignored), ``--concurrency`` at a time, each under one of ``--adapters``
   random adapters (rank ``--rank`` on ``--targets``, written with peft by scripts/make_lora.py)
   drawn with Zipf popularity (``--zipf``); then the same requests on the base alone. Target:
   the mix costs <= 1.3x the base.
2. One stream: a request of ``--single-output-len`` tokens with and without an adapter; decode
   tok/s = (tokens - 1) / (full time - time to the first token). Target: >= 0.85x.
3. HF transformers + PEFT on the same mix (``--hf``): every adapter loaded, batches of
   ``--concurrency`` rows generated with PEFT's mixed-adapter batches (``adapter_names``).
   vLLM's CPU build is not run here: its LoRA path was not available to test beside this engine.

    python scripts/bench_lora.py --out bench_results/lora.json
    python scripts/bench_lora.py --requests 16 --output-len 16 --repeats 1 --no-hf   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

from asyncengine.script_main import run_main

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def write_adapters(model: str, root: Path, count: int, rank: int, targets: list[str]) -> dict:
    from make_lora import base_model, random_adapter

    base = base_model(model)
    out = {}
    for i in range(count):
        path = root / f"lora{i}"
        if not (path / "adapter_model.safetensors").is_file():
            random_adapter(base, path, rank, targets, seed=i)
        out[f"lora{i}"] = str(path)
    return out


def workload(args: argparse.Namespace, names: list[str]) -> tuple[list[list[int]], list[str]]:
    rng = np.random.default_rng(args.seed)
    prompts = [
        [int(t) for t in rng.integers(100, 40000, args.prompt_len)] for _ in range(args.requests)
    ]
    weights = 1.0 / np.arange(1, len(names) + 1) ** args.zipf
    picks = rng.choice(len(names), size=args.requests, p=weights / weights.sum())
    return prompts, [names[i] for i in picks]


async def run_engine(args: argparse.Namespace, loras: dict[str, str]) -> dict[str, Any]:
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.config import EngineConfig
    from asyncengine.common.sampling_params import SamplingParams

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        loras=loras,
        max_loras=args.adapters,
        max_running_requests=args.concurrency,
        log_interval=0,
        enable_prefix_cache=False,
    )
    prompts, picks = workload(args, sorted(loras))

    def params(lora: str | None, n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, lora=lora)

    async with AsyncEngine(config) as engine:

        async def mix(with_adapters: bool) -> float:
            started = time.perf_counter()
            await asyncio.gather(
                *(
                    engine.generate(p, params(lora if with_adapters else None, args.output_len))
                    for p, lora in zip(prompts, picks, strict=True)
                )
            )
            return time.perf_counter() - started

        async def timed(lora: str | None, n: int) -> float:
            started = time.perf_counter()
            await engine.generate(prompts[0][:16], params(lora, n))
            return time.perf_counter() - started

        async def stream(lora: str | None) -> float:
            first = statistics.median([await timed(lora, 1) for _ in range(3)])
            full = await timed(lora, args.single_output_len)
            return (args.single_output_len - 1) / (full - first)

        await mix(True)  # warm-up: kernels compiled, adapters touched
        times: dict[str, list[float]] = {"mix": [], "base": [], "stream_lora": [], "stream": []}
        for _ in range(args.repeats):
            times["mix"].append(await mix(True))
            times["base"].append(await mix(False))
            times["stream_lora"].append(await stream(picks[0]))
            times["stream"].append(await stream(None))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.requests * args.output_len
    return {
        "mix_output_tok_s": tokens / med["mix"],
        "base_output_tok_s": tokens / med["base"],
        "mix_cost_vs_base": med["mix"] / med["base"],
        "stream_decode_tok_s_with_adapter": med["stream_lora"],
        "stream_decode_tok_s_base": med["stream"],
        "stream_ratio": med["stream_lora"] / med["stream"],
        "raw": times,
    }


def run_hf_peft(args: argparse.Namespace, loras: dict[str, str]) -> dict[str, Any]:
    from make_lora import base_model
    from peft import PeftModel

    dtype = torch.float32 if args.dtype in ("float32", "auto") else getattr(torch, args.dtype)
    names = sorted(loras)
    model = PeftModel.from_pretrained(base_model(args.model, dtype), loras[names[0]], names[0])
    for name in names[1:]:
        model.load_adapter(loras[name], adapter_name=name)
    model.eval()
    prompts, picks = workload(args, names)
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for i in range(0, len(prompts), args.concurrency):
            batch = torch.tensor(prompts[i : i + args.concurrency])  # same length: no padding
            with torch.no_grad():
                model.generate(
                    input_ids=batch,
                    attention_mask=torch.ones_like(batch),
                    max_new_tokens=args.output_len,
                    min_new_tokens=args.output_len,
                    do_sample=False,
                    adapter_names=picks[i : i + args.concurrency],
                )
        seconds.append(time.perf_counter() - started)
    return {"hf_peft_output_tok_s": args.requests * args.output_len / statistics.median(seconds)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=ALL_TARGETS)
    parser.add_argument("--adapter-dir", type=Path, help="keep the adapters here (default: temp)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--single-output-len", type=int, default=128)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF + PEFT")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.adapter_dir or Path(tmp)
        loras = write_adapters(args.model, root, args.adapters, args.rank, args.targets.split(","))
        result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
        result.update(asyncio.run(run_engine(args, loras)))
        if args.hf:
            result.update(run_hf_peft(args, loras))
            result["vs_hf_peft"] = result["mix_output_tok_s"] / result["hf_peft_output_tok_s"]
    result["vllm"] = "not measured: its CPU build's LoRA serving was not available to test"
    shown = {k: v for k, v in result.items() if k not in ("raw", "args")}
    print(json.dumps(shown, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    run_main(main)
