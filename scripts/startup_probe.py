#!/usr/bin/env python
"""One cold start of asyncengine, timed by phase, in a process of its own (bench_real_sizes.py
--startup-only runs it; it prints one JSON line).

    .venv/bin/python scripts/startup_probe.py MODEL --config-json '{"kv_cache_tokens": 2304}' \\
        --prompt-len 16 --spawned-at "$(date +%s.%N)"

Phases, each its own figure (the interpreter's imports are not the model's load, and are said
apart from it):
- ``interpreter_seconds``: from ``--spawned-at`` (the parent's clock when it started this
  process) to the first line of this script;
- ``imports_seconds``: importing torch and asyncengine's engine, the garbage collector paused
  as the ``asyncengine`` command pauses it;
- ``load_seconds``: ``AsyncEngine.start()``, until the engine takes requests: the model read,
  its weights packed, kernels loaded, the tokenizer, the KV pool (what llama-server does before
  it answers ``/health``);
- ``first_request_seconds``, ``second_request_seconds``: a ``--prompt-len``-token prompt, one
  token out, sent once ready, then another of the same length (new tokens: no prefix hit). A
  first request that paid for work the start deferred would show here, beside the second.
- ``stream_at_start_seconds``, ``stream_settled_seconds`` (``--stream-len`` N > 1): a new prompt
  with N tokens out right after those, while the work the start deferred (huge pages, the int8
  panels) may still run, then another once it is done: a first stream's decode beside a settled
  one's.
"""

from __future__ import annotations

import time

_MAIN_AT = time.time()  # first, before any import

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def prompt_ids(length: int, offset: int) -> list[int]:
    """Ids no other prompt of the run starts with (3..; offset apart)."""
    return [3 + (offset + i) % 40000 for i in range(length)]


async def measure(
    model: str, settings: dict[str, Any], prompt_len: int, stream_len: int = 0
) -> dict[str, Any]:
    imports_at = time.time()
    from asyncengine.cli import collector_paused_for_imports

    with collector_paused_for_imports():  # as ``asyncengine serve`` imports
        from asyncengine.api.engine import AsyncEngine
        from asyncengine.common.config import EngineConfig
        from asyncengine.common.sampling_params import SamplingParams

    config = EngineConfig.from_toml(None, model=model, **settings)
    one_token = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    load_at, load_cpu = time.time(), _cpu_seconds()
    async with AsyncEngine(config) as engine:
        ready_at, ready_cpu = time.time(), _cpu_seconds()
        requests = []
        for offset in (1000, 20000):
            start = time.perf_counter()
            out = await engine.generate(prompt_ids(prompt_len, offset), one_token)
            requests.append(time.perf_counter() - start)
            if len(out.token_ids) != 1:
                raise RuntimeError(f"asyncengine gave {len(out.token_ids)} tokens, not 1")

        async def stream_seconds(offset: int) -> float:
            many = SamplingParams(max_new_tokens=stream_len, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            out = await engine.generate(prompt_ids(prompt_len, offset), many)
            if len(out.token_ids) != stream_len:
                raise RuntimeError(f"asyncengine gave {len(out.token_ids)} of {stream_len}")
            return time.perf_counter() - start

        streams = {}
        if stream_len > 1:
            streams["stream_at_start_seconds"] = await stream_seconds(30000)
            await engine.one_time_work_done()
            streams["stream_settled_seconds"] = await stream_seconds(35000)
    return {
        **streams,
        "imports_seconds": load_at - imports_at,
        "load_seconds": ready_at - load_at,
        "load_cpu_seconds": ready_cpu - load_cpu,
        "first_request_seconds": requests[0],
        "second_request_seconds": requests[1],
        "ready_at": ready_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--config-json", default="{}", help="engine config keys, as JSON")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--stream-len", type=int, default=0, help="tokens of the two streams")
    parser.add_argument("--spawned-at", type=float, default=None, help="the parent's time.time()")
    args = parser.parse_args()
    settings = json.loads(args.config_json)
    row = asyncio.run(measure(args.model, settings, args.prompt_len, args.stream_len))
    spawned = args.spawned_at if args.spawned_at is not None else _MAIN_AT
    row["interpreter_seconds"] = _MAIN_AT - spawned
    row["process_to_ready_seconds"] = row.pop("ready_at") - spawned
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
