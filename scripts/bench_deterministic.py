#!/usr/bin/env python
"""What deterministic mode costs, and that it does what it says: the same requests on two
engines, ``deterministic`` off and on, side by side in one run.

- ``offline``: every request submitted at once (greedy, EOS ignored, each its own prompt and
  output length); output tokens per second, wall time from the first submission to the last
  finish.
- ``single``: one request alone, decode-dominated (batch 1); output tokens per second.
Runs alternate between the two engines (off, on, off, on, ...) so that the machine's load
falls on both alike; the table gives medians of ``--repeats`` and the ratio on/off. Both
engines share one process, whose libgomp then counts more threads than cores and spins less at
each barrier than a lone server's: beside busy processes, measure each mode in a process of its
own (``scripts/bench_neighbours.py --deterministic``).

Batch invariance is checked in the same run: ``--check`` requests are generated one at a time
(each alone in its batch), then the same requests in the middle of the offline batch; the
report counts the requests whose tokens differ, for each mode.

    .venv/bin/python scripts/bench_deterministic.py                 # embedded model, bfloat16
    .venv/bin/python scripts/bench_deterministic.py --num-requests 64 --out det.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.common.config import EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.script_main import run_main

MODES = {"default": False, "deterministic": True}


@dataclass(slots=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class ModeResult:
    offline_tok_s: list[float] = field(default_factory=list)
    single_tok_s: list[float] = field(default_factory=list)
    differing: int = 0  # of the checked requests, those whose tokens alone != in the batch
    first_difference: list[int | None] = field(default_factory=list)


def make_requests(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    return [
        Request(
            [
                rng.randrange(10, vocab)
                for _ in range(rng.randint(args.min_prompt, args.max_prompt))
            ],
            rng.randint(args.min_output, args.max_output),
        )
        for _ in range(args.num_requests)
    ]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


async def offline(engine: Any, requests: list[Request]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = await asyncio.gather(
        *(engine.generate(r.prompt, greedy(r.output_len)) for r in requests)
    )
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


async def single(engine: Any, request: Request, tokens: int) -> float:
    start = time.perf_counter()
    out = await engine.generate(request.prompt, greedy(tokens))
    return len(out.token_ids) / (time.perf_counter() - start)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from asyncengine.api.engine import AsyncEngine

    engines = {}
    for name, deterministic in MODES.items():
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            log_interval=0,
            kv_cache_tokens=args.kv_cache_tokens,
            max_running_requests=args.num_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            deterministic=deterministic,
        )
        engines[name] = await AsyncEngine(config).start()
    vocab = engines["default"].vocab_size
    requests = make_requests(args, vocab)
    results = {name: ModeResult() for name in MODES}
    load_start = os.getloadavg()[0]
    try:
        for name, engine in engines.items():  # warm-up, and the invariance check
            await single(engine, requests[0], 4)
            checked = requests[: args.check]
            alone = [
                (await engine.generate(r.prompt, greedy(r.output_len))).token_ids for r in checked
            ]
            await engine.reset_prefix_cache()
            _, batched = await offline(engine, requests)
            await engine.reset_prefix_cache()
            diffs = [first_difference(a, b) for a, b in zip(alone, batched, strict=False)]
            results[name].first_difference = diffs
            results[name].differing = sum(d is not None for d in diffs)
        for repeat in range(args.repeats):
            for name, engine in engines.items():
                tok_s, _ = await offline(engine, requests)
                await engine.reset_prefix_cache()
                results[name].offline_tok_s.append(tok_s)
                results[name].single_tok_s.append(
                    await single(engine, requests[repeat % len(requests)], args.single_tokens)
                )
                await engine.reset_prefix_cache()
                print(
                    f"repeat {repeat + 1}/{args.repeats} {name:13} offline {tok_s:7.1f} tok/s  "
                    f"single {results[name].single_tok_s[-1]:6.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for engine in engines.values():
            await engine.stop()
    return {
        "args": vars(args) | {"out": str(args.out) if args.out else None},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg()[0],
        },
        "workload": {
            "requests": len(requests),
            "prompt_tokens": sum(len(r.prompt) for r in requests),
            "output_tokens": sum(r.output_len for r in requests),
        },
        "results": {name: asdict(r) for name, r in results.items()},
    }


def table(report: dict[str, Any]) -> str:
    res = report["results"]
    med = {
        name: (statistics.median(r["offline_tok_s"]), statistics.median(r["single_tok_s"]))
        for name, r in res.items()
    }
    checked = report["args"]["check"]
    lines = [
        "| mode | offline out tok/s | single-stream tok/s | requests differing alone vs batched |",
        "| --- | --- | --- | --- |",
    ]
    for name, (off, one) in med.items():
        lines.append(f"| {name} | {off:.1f} | {one:.1f} | {res[name]['differing']} of {checked} |")
    (d_off, d_one), (n_off, n_one) = med["deterministic"], med["default"]
    lines.append(f"| deterministic / default | {d_off / n_off:.2f} | {d_one / n_one:.2f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=320)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--single-tokens", type=int, default=32)
    parser.add_argument("--check", type=int, default=8, help="requests checked alone vs batched")
    parser.add_argument("--chunked-prefill-size", type=int, default=256)
    parser.add_argument("--kv-cache-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    report["table"] = table(report)
    print(report["table"])
    print(
        f"load average {report['machine']['load_average_start']:.1f} -> "
        f"{report['machine']['load_average_end']:.1f} on {report['machine']['cpus']} CPUs"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    run_main(main)
