#!/usr/bin/env python
"""Speculative decoding (prompt lookup, a draft model) on and off, and llama.cpp's n-gram one.

Workloads (asyncengine/workloads/copy_heavy.py): copy-heavy chat prompts (rewrite or edit a code
file or a passage given in the prompt), random-text ones ("continue these random words") and
random-number ones ("continue these random numbers": digits, whose short n-grams recur, so
lookup guesses and the guesses fail: speculation-hostile).
Each request is greedy with EOS ignored and ``--output-len`` tokens.

Modes, each its own engine, all loaded once and run back to back per repeat (the machine is
shared: compare within one repeat): ``off``, ``fixed`` (``num_speculative_tokens`` guesses
whenever lookup finds them) and ``adaptive`` (speculative/rules.py); ``draft_fixed`` and
``draft_adaptive`` the same rules with ``--draft-model`` guessing (``--draft-k`` guesses; make
one with scripts/make_draft_model.py). Batch 1: the requests one
at a time, decode tok/s of each = (output_len - 1) / (e2e - ttft), the median reported; batch B:
B requests at once (the prompts cycled), output tokens / wall seconds. With ``--llamacpp``,
llama-server on the same GGUF (Q4_1, the embedded model) without speculation and with
``--spec-type ngram-simple`` (lookup n-gram ``--llamacpp-ngram-n``, ``--llamacpp-ngram-m``
drafted), its own ``predicted_per_second`` at batch 1.

    python scripts/bench_speculative.py --out bench_results/speculative.json --llamacpp
    python scripts/bench_speculative.py --batches 1 --prompts 2 --output-len 32
    python scripts/bench_speculative.py --batches 1 --modes off draft_fixed draft_adaptive \
        --draft-model ~/.cache/asyncengine/smollm2-135m-first6-draft.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/peers (--llamacpp)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.config import EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.script_main import run_main
from asyncengine.workloads.copy_heavy import (
    copy_heavy_prompts,
    random_number_prompts,
    random_text_prompts,
)

WORKLOADS = {
    "copy": copy_heavy_prompts,
    "random": random_text_prompts,
    "numbers": random_number_prompts,
}
DRAFT_PREFIX = "draft_"


def mode_config(mode: str, args: argparse.Namespace) -> EngineConfig:
    speculative: dict[str, Any] | None = None
    if mode.startswith(DRAFT_PREFIX):
        speculative = {
            "method": "draft",
            "model": args.draft_model,
            "num_speculative_tokens": args.draft_k,
            "rule": mode.removeprefix(DRAFT_PREFIX),
        }
    elif mode != "off":
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
            "rule": mode,
        }
    if speculative is not None and args.max_verify_tokens is not None:
        speculative["max_verify_tokens"] = args.max_verify_tokens
    return EngineConfig(
        model=args.model,
        kv_cache_tokens=args.kv_cache_tokens,
        max_running_requests=max(args.batches),
        log_interval=0,
        speculative=speculative,
    )


async def run_batch(
    engine: AsyncEngine, prompts: list[list[int]], batch: int, output_len: int
) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    if batch == 1:
        rates = []
        for prompt in prompts:
            out = await engine.generate(prompt, params)
            decode = out.metrics.e2e - (out.metrics.ttft or 0.0)
            rates.append((len(out.token_ids) - 1) / decode)
        result: dict[str, Any] = {"decode_tok_s": statistics.median(rates), "per_request": rates}
    else:
        requests = [prompts[i % len(prompts)] for i in range(batch)]
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, params) for p in requests))
        wall = time.perf_counter() - start
        result = {"tok_s": sum(len(o.token_ids) for o in outs) / wall, "wall_s": wall}
    after = engine.stats()
    verified = after.get("spec_verified_tokens", 0) - before.get("spec_verified_tokens", 0)
    accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    result["acceptance"] = accepted / verified if verified else None
    result["accepted_tokens"] = accepted
    return result


def llamacpp_runs(
    prompts: dict[str, list[list[int]]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Batch-1 decode tok/s of llama-server without and with its n-gram speculation."""
    import aiohttp
    from peers.llamacpp import launcher as peer_llamacpp

    spec = (
        "--spec-type", "ngram-simple",
        "--spec-ngram-simple-size-n", str(args.llamacpp_ngram_n),
        "--spec-ngram-simple-size-m", str(args.llamacpp_ngram_m),
    )  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    for name, extra in (("llamacpp_off", ()), ("llamacpp_ngram", spec)):
        server = peer_llamacpp.LlamaServer(
            peer_llamacpp.model_file("q4_1"), parallel=1, threads=args.threads, extra_args=extra
        )

        async def measure(server: peer_llamacpp.LlamaServer) -> dict[str, Any]:
            out: dict[str, Any] = {}
            async with aiohttp.ClientSession() as session:
                await server.complete(session, list(range(3, 19)), 4)  # warm-up
                for workload, token_lists in prompts.items():
                    rates, drafted, accepted = [], 0, 0
                    for ids in token_lists:
                        reply = await server.complete(session, ids, args.output_len)
                        timings = reply["timings"]
                        rates.append(float(timings["predicted_per_second"]))
                        drafted += int(timings.get("draft_n", 0))
                        accepted += int(timings.get("draft_n_accepted", 0))
                    out[workload] = {
                        "decode_tok_s": statistics.median(rates),
                        "per_request": rates,
                        "acceptance": accepted / drafted if drafted else None,
                    }
            return out

        with server:
            results[name] = asyncio.run(measure(server))
    return results


async def run_engines(args: argparse.Namespace) -> dict[str, Any]:
    modes = args.modes
    engines = {mode: AsyncEngine(mode_config(mode, args)) for mode in modes}
    for engine in engines.values():
        await engine.start()
    try:
        first = engines[modes[0]]
        prompts = {
            name: [
                list(first.intake.tokenize(p))  # type: ignore[arg-type]
                for p in WORKLOADS[name](args.prompts, args.seed)
            ]
            for name in args.workloads
        }
        warm = SamplingParams(max_new_tokens=4, temperature=0.0)
        for engine in engines.values():
            await engine.generate(prompts[args.workloads[0]][0], warm)
        rows: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            for workload in args.workloads:
                for batch in args.batches:
                    for mode in modes:
                        load = os.getloadavg()[0]
                        result = await run_batch(
                            engines[mode], prompts[workload], batch, args.output_len
                        )
                        rows.append(
                            {
                                "repeat": repeat,
                                "workload": workload,
                                "batch": batch,
                                "mode": mode,
                                "load_avg_1m": load,
                                **result,
                            }
                        )
                        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_request"}))
        return {"rows": rows, "prompts": prompts}
    finally:
        for engine in engines.values():
            await engine.stop()


def summary(rows: list[dict[str, Any]], modes: Sequence[str]) -> list[str]:
    """One line per (workload, batch): each mode's median speed and its ratio to off."""
    lines = []
    keys = sorted({(r["workload"], r["batch"]) for r in rows})
    for workload, batch in keys:
        speeds: dict[str, float] = {}
        ratios: dict[str, float] = {}
        for mode in modes:
            picked = [
                r for r in rows if (r["workload"], r["batch"], r["mode"]) == (workload, batch, mode)
            ]
            speed = [r.get("decode_tok_s") or r.get("tok_s") for r in picked]
            speeds[mode] = statistics.median(speed)
        for mode in modes:
            per_repeat = []
            for repeat in {r["repeat"] for r in rows}:
                pair = {
                    r["mode"]: r.get("decode_tok_s") or r.get("tok_s")
                    for r in rows
                    if (r["workload"], r["batch"], r["repeat"]) == (workload, batch, repeat)
                }
                per_repeat.append(pair[mode] / pair["off"])
            ratios[mode] = statistics.median(per_repeat)
        cells = "  ".join(f"{m} {speeds[m]:7.1f} tok/s ({ratios[m]:.2f}x)" for m in modes)
        lines.append(f"{workload:>6} batch {batch:>3}: {cells}")
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--workloads", nargs="+", default=["copy", "random"], choices=WORKLOADS)
    parser.add_argument("--modes", nargs="+", default=["off", "fixed", "adaptive"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--draft-model", default=None, help="for the draft_* modes")
    parser.add_argument("--draft-k", type=int, default=3, help="draft num_speculative_tokens")
    parser.add_argument(
        "--max-verify-tokens", type=int, default=None, help="speculative.max_verify_tokens"
    )
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llamacpp", action="store_true", help="also llama.cpp, batch 1")
    parser.add_argument("--llamacpp-ngram-n", type=int, default=3)
    parser.add_argument("--llamacpp-ngram-m", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.modes[0] != "off":
        raise ValueError("--modes must start with off (the ratios are to it)")
    if any(m.startswith(DRAFT_PREFIX) for m in args.modes) and args.draft_model is None:
        raise ValueError("the draft_* modes need --draft-model")
    load_before = os.getloadavg()
    ran = asyncio.run(run_engines(args))
    result: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load_avg_before": load_before,
        "rows": ran["rows"],
    }
    if args.llamacpp:
        result["llamacpp"] = llamacpp_runs(ran["prompts"], args)
    result["load_avg_after"] = os.getloadavg()
    print("\n".join(summary(ran["rows"], args.modes)))
    for name, per_workload in result.get("llamacpp", {}).items():
        for workload, r in per_workload.items():
            print(
                f"{name} {workload} batch 1: {r['decode_tok_s']:.1f} tok/s, acceptance {r['acceptance']}"
            )
    print(f"load average before {load_before}, after {result['load_avg_after']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    run_main(main)
