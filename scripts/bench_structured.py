"""What structured output and n > 1 cost on the real engine, side by side in one run.

1. Grammar compile: a JSON schema compiled cold (a fresh compiler, its tokenizer info built
   first), and looked up again from the cache.
2. Decode: ``--requests`` concurrent sampled requests of ``--tokens`` tokens, unconstrained vs
   constrained by a JSON schema (bounded, so outputs end) and by ``json_object``: generated
   tokens per second of wall time, median of ``--repeats``.
3. Per token: bitmask fill and matcher accept, and what masking adds to sampling 8 rows.
4. n > 1: one request with n = ``--n`` choices vs n separate requests of the same prompt
   (cache reset before each), counting the prompt tokens the engine computed.

    .venv/bin/python scripts/bench_structured.py                 # embedded default model
    .venv/bin/python scripts/bench_structured.py --model path/to/hf_dir --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.common.plan import BatchPlan
from asyncengine.common.sampling_params import StructuredOutput
from asyncengine.executor.loader import DEFAULT_MODEL
from asyncengine.structured import GrammarCompiler

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as a JSON object."}]


async def compile_times(engine: AsyncEngine) -> dict[str, float]:
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.tokenizer.eos_token_ids)
    constraint = StructuredOutput.json_schema(SCHEMA)
    start = time.perf_counter()
    await compiler.compile(constraint)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(100):
        await compiler.compile(constraint)
    cached = (time.perf_counter() - start) / 100
    compiler.close()
    return {"cold_compile_s": cold, "cached_lookup_s": cached}


async def per_token_costs(engine: AsyncEngine, repeats: int) -> dict[str, float]:
    """Median seconds, over the tokens of one constrained output: filling the next-token
    bitmask (on the event loop, at schedule), accepting a token (at commit), and what masking
    adds to sampling a batch of 8 rows (one of them, and all of them, constrained)."""
    import torch

    from asyncengine.common.plan import SamplingInfo
    from asyncengine.executor.sampler import Sampler
    from asyncengine.structured import GrammarMatcher

    constraint = StructuredOutput.json_schema(SCHEMA)
    out = await engine.generate(
        MESSAGES, SamplingParams(max_new_tokens=96, seed=0, structured=constraint)
    )
    compiled = await engine.held.compiler.compile(constraint)
    fills: list[float] = []
    accepts: list[float] = []
    masks = []
    matcher = GrammarMatcher(compiled)
    for token in out.token_ids:
        start = time.perf_counter()
        masks.append(matcher.next_bitmask())
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert matcher.accept(token)
        accepts.append(time.perf_counter() - start)
    logits = torch.randn(8, engine.vocab_size)
    sampler = Sampler(seed=0)
    params = SamplingParams(temperature=0.7, seed=1)

    def sample_time(constrained: int) -> float:
        rows = [
            SamplingInfo(params, [], [], masks[i % len(masks)] if i < constrained else None)
            for i in range(8)
        ]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sampler.sample(logits, rows)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    plain = sample_time(0)
    return {
        "output_tokens": len(out.token_ids),
        "fill_bitmask_s": statistics.median(fills),
        "accept_s": statistics.median(accepts),
        "sample_8_rows_s": plain,
        "sample_8_rows_1_masked_s": sample_time(1),
        "sample_8_rows_8_masked_s": sample_time(8),
    }


async def decode_rate(
    engine: AsyncEngine, structured: StructuredOutput | None, requests: int, tokens: int
) -> tuple[float, int]:
    params = [
        SamplingParams(max_new_tokens=tokens, temperature=0.7, seed=i, structured=structured)
        for i in range(requests)
    ]
    start = time.perf_counter()
    outputs = await asyncio.gather(*(engine.generate(MESSAGES, p) for p in params))
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    return generated / elapsed, generated


async def prefill_tokens(engine: AsyncEngine, n: int, forked: bool) -> int:
    await engine.reset_prefix_cache()
    counted: list[int] = []

    def count(plan: BatchPlan) -> None:
        counted.append(sum(seg.num_tokens for seg in plan.extends))

    engine.step_hooks.append(count)
    try:
        prompt = "Tell me a long story about a lighthouse keeper. " * 8
        if forked:
            await engine.generate_choices(prompt, SamplingParams(n=n, max_new_tokens=4, seed=1))
        else:
            await asyncio.gather(
                *(
                    engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=i))
                    for i in range(n)
                )
            )
    finally:
        engine.step_hooks.remove(count)
    return sum(counted)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        log_interval=0,
        # n separate prompts: each computes its prompt (neither deferred nor shared in a step)
        enable_inbatch_prefix_dedup=False,
        enable_in_step_prefix_sharing=False,
    )
    async with AsyncEngine(config) as engine:
        result: dict[str, Any] = {"model": args.model, "loadavg": os.getloadavg()}
        result["compile"] = await compile_times(engine)
        print(f"  compile: {result['compile']}", file=sys.stderr, flush=True)
        modes = {
            "none": None,
            "json_schema": StructuredOutput.json_schema(SCHEMA),
            "json_object": StructuredOutput("json_object"),
        }
        await decode_rate(engine, modes["json_schema"], 2, 8)  # warm-up (and the compile)
        rates: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(args.repeats):
            for name, structured in modes.items():  # interleaved: load drifts hit all alike
                rate, _ = await decode_rate(engine, structured, args.requests, args.tokens)
                rates[name].append(rate)
                print(f"  {name}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
        result["decode_tokens_per_s"] = {k: statistics.median(v) for k, v in rates.items()}
        result["per_token"] = await per_token_costs(engine, max(20, 10 * args.repeats))
        result["prefill_tokens"] = {
            f"n={args.n} (fork)": await prefill_tokens(engine, args.n, forked=True),
            f"{args.n} separate requests": await prefill_tokens(engine, args.n, forked=False),
        }
        result["loadavg_after"] = os.getloadavg()
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"model {result['model']}; load {result['loadavg']} -> {result['loadavg_after']}")
    c = result["compile"]
    print(
        f"grammar compile: cold {c['cold_compile_s'] * 1e3:.1f} ms, "
        f"cached {c['cached_lookup_s'] * 1e6:.1f} us"
    )
    base = result["decode_tokens_per_s"]["none"]
    print(f"{'mode':<14}{'tok/s':>10}{'vs none':>10}")
    for name, rate in result["decode_tokens_per_s"].items():
        print(f"{name:<14}{rate:>10.1f}{rate / base:>10.2f}")
    t = result["per_token"]
    print(
        f"per token: fill bitmask {t['fill_bitmask_s'] * 1e6:.0f} us, accept "
        f"{t['accept_s'] * 1e6:.0f} us; sampling 8 rows {t['sample_8_rows_s'] * 1e3:.2f} ms, "
        f"1 masked {t['sample_8_rows_1_masked_s'] * 1e3:.2f} ms, "
        f"8 masked {t['sample_8_rows_8_masked_s'] * 1e3:.2f} ms"
    )
    for name, tokens in result["prefill_tokens"].items():
        print(f"prefill tokens computed, {name}: {tokens}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
