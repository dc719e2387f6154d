#!/usr/bin/env python
"""Prompt steps with the MLP over row chunks (``LlamaModel._mlp``, ``MLP_CHUNK_BYTES``) against
the whole step's rows at once, alternating round by round in one process: wall time and minor
page faults (a gate/up output over glibc's mmap threshold is a fresh mapping, faulted in page by
page, every layer).

The engine starts on ``--model`` and finishes its one-time work; each round sends ``--prompts``
prompts of ``--prompt-len`` random tokens at once, one token out (prompt steps of the token
budget's rows), one round each way as a warm-up, then ``--rounds`` rounds each way (the order
flipped every round). Prints the medians and the ratio; a busy machine slows both alike.
``ASYNCENGINE_ADAPTIVE_THREADS=0`` keeps every step on all threads (executor/cpu/step_threads.py:
beside other processes it may move a step to one thread, whatever the side).

    ASYNCENGINE_ADAPTIVE_THREADS=0 .venv/bin/python scripts/micro/bench_prompt_faults.py \\
        --model ~/.cache/asyncengine/models/qwen2.5-1.5b/qwen2.5-1.5b-Q4_K_M.gguf --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.config import EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.layers.model import LlamaModel

WHOLE = 0  # gate_up_row_bytes that makes one chunk of any step


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    tokens = args.prompts * args.prompt_len
    config = EngineConfig.from_toml(
        None,
        model=args.model,
        device="cpu",
        log_interval=0.0,
        # sized as scripts/bench_real_sizes.py sizes its concurrent case (as many tokens out as
        # in): its prompt steps are of ``chunked_prefill_size`` rows
        max_model_len=2 * args.prompt_len + 1,
        kv_cache_tokens=2 * tokens + 256,
    )
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    async with AsyncEngine(config) as engine:
        await engine.one_time_work_done()
        model = engine._core().executor.runner.model  # type: ignore[attr-defined]
        assert isinstance(model, LlamaModel)
        chunked = model.gate_up_row_bytes

        async def one_round(row_bytes: int) -> tuple[float, int]:
            model.gate_up_row_bytes = row_bytes
            prompts = [
                [int(t) for t in rng.integers(3, 30000, args.prompt_len)]
                for _ in range(args.prompts)
            ]
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            await asyncio.gather(*(engine.generate(p, one) for p in prompts))
            seconds = time.perf_counter() - start
            return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        await one_round(WHOLE)
        await one_round(chunked)
        rows: dict[str, list[tuple[float, int]]] = {"whole": [], "chunked": []}
        for r in range(args.rounds):
            sides = ("whole", "chunked") if r % 2 == 0 else ("chunked", "whole")
            for side in sides:
                rows[side].append(await one_round(WHOLE if side == "whole" else chunked))
    medians = {
        side: {
            "wall": statistics.median(w for w, _ in values),
            "faults": statistics.median(f for _, f in values),
        }
        for side, values in rows.items()
    }
    return {
        "prompt_tokens": tokens,
        "rounds": rows,
        "medians": medians,
        "chunked_speedup": medians["whole"]["wall"] / medians["chunked"]["wall"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result))
    m = result["medians"]
    print(
        f"prompt steps: chunked MLP {result['chunked_speedup']:.3f}x the whole rows "
        f"({m['chunked']['wall']:.2f} s vs {m['whole']['wall']:.2f} s for "
        f"{result['prompt_tokens']} tokens; page faults {m['chunked']['faults']:.0f} vs "
        f"{m['whole']['faults']:.0f})"
    )


if __name__ == "__main__":
    main()
