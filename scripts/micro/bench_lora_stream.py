"""A batch-1 decode step with an adapter against one without, on this tree's fused decode step and
on another build of it (``--baseline-library``), alternating in one process: a before/after of
the LoRA pass on a busy machine. The engine decodes ``--context`` greedy tokens of one request
with an adapter (random, rank ``--rank`` on every target, scripts/make_lora.py) and one without,
keeping each one's last step call; each round then replays both calls ``--steps`` times per
library, in this process's CPU time (``--wall``: the wall clock; ``--threads 1`` for the step's
own cost on a busy machine). Prints each library's medians and the ratio (without / with: the
one-stream tok/s ratio of the step alone, target >= 0.85).

    .venv/bin/python scripts/micro/bench_lora_stream.py --threads 1 \\
        --baseline-library ~/.cache/asyncengine/kernels/cpu_decode_step-<old hash>.so
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncengine.script_main import run_main

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


_SHOWN: set[torch.dtype] = set()  # pools whose baseline was named


def _swap_library(path: Path | None) -> Callable[[], None]:
    """Make the fused step load ``path`` (None: this tree's build); returns the undo."""
    from asyncengine.kernels.cpu import decode_step_native

    original = decode_step_native._library
    if path is None:
        return lambda: None
    other = ctypes.CDLL(str(path))

    def library(kv_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
        own = original(kv_dtype)
        if kv_dtype not in _SHOWN:  # the baseline must be the build for this pool
            _SHOWN.add(kv_dtype)
            print(f"baseline for a {kv_dtype} pool: {path}")
        if own is None:
            return None
        for name in ("asyncengine_decode_step", "asyncengine_group_attention"):
            getattr(other, name).restype = getattr(own, name).restype
            getattr(other, name).argtypes = getattr(own, name).argtypes
        return other

    decode_step_native._library = library  # type: ignore[assignment]

    def undo() -> None:
        decode_step_native._library = original  # type: ignore[assignment]

    return undo


async def capture(args: argparse.Namespace, lora_path: str) -> dict[str, tuple]:
    """One batch-1 decode step's call with the adapter and one without, as the engine made them."""
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.config import EngineConfig
    from asyncengine.common.sampling_params import SamplingParams
    from asyncengine.kernels.cpu.decode_step_native import DecodeStepModel

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        loras={"a": lora_path},
        max_running_requests=1,
        log_interval=0,
        enable_prefix_cache=False,
    )
    calls: dict[str, tuple] = {}
    original = DecodeStepModel.step

    def recording(self: DecodeStepModel, *step_args: object) -> torch.Tensor:
        key = "base" if len(step_args) < 8 or step_args[7] is None else "lora"
        calls[key] = (self, step_args)
        return original(self, *step_args)

    DecodeStepModel.step = recording  # type: ignore[method-assign]
    try:
        async with AsyncEngine(config) as engine:
            for lora in ("a", None):
                params = SamplingParams(
                    max_new_tokens=args.context, temperature=0.0, ignore_eos=True, lora=lora
                )
                await engine.generate(list(range(100, 116)), params)
    finally:
        DecodeStepModel.step = original  # type: ignore[method-assign]
    return calls


def replay(args: argparse.Namespace, calls: dict[str, tuple]) -> dict[str, dict[str, float]]:
    """Each library's median step cost (ms) with and without the adapter, alternating."""
    from asyncengine.kernels.cpu.decode_step_native import DecodeStepModel

    clock = time.perf_counter if args.wall else time.process_time
    libraries: dict[str, Path | None] = {"new": None}
    if args.baseline_library is not None:
        libraries["old"] = args.baseline_library
    costs: dict[str, dict[str, list[float]]] = {
        name: {"lora": [], "base": []} for name in libraries
    }
    for round_ in range(args.rounds + 1):  # the first: warm-up
        for name, path in libraries.items():
            undo = _swap_library(path)
            for key, (model, step_args) in calls.items():
                started = clock()
                for _ in range(args.steps):
                    DecodeStepModel.step(model, *step_args)
                if round_:
                    costs[name][key].append((clock() - started) / args.steps)
            undo()
    result = {}
    for name, by in costs.items():
        lora_ms = statistics.median(by["lora"]) * 1e3
        base_ms = statistics.median(by["base"]) * 1e3
        result[name] = {"lora_ms": lora_ms, "base_ms": base_ms, "ratio": base_ms / lora_ms}
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=64, help="tokens decoded before the step")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed sample")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, help="the step's threads (default: torch's)")
    parser.add_argument("--wall", action="store_true", help="wall clock instead of CPU time")
    parser.add_argument("--baseline-library", type=Path)
    args = parser.parse_args(argv)
    from make_lora import base_model, random_adapter

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a"
        random_adapter(base_model(args.model), path, args.rank, ALL_TARGETS, seed=0)
        calls = asyncio.run(capture(args, str(path)))
    torch.set_num_threads(args.threads or torch.get_num_threads())
    result = replay(args, calls)
    print(f"load average {os.getloadavg()[0]:.1f}, threads {torch.get_num_threads()}")
    for name, row in result.items():
        print(
            f"{name}: step ms with adapter {row['lora_ms']:.2f}, "
            f"without {row['base_ms']:.2f}, ratio {row['ratio']:.3f}"
        )


if __name__ == "__main__":
    run_main(main)
