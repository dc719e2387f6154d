#!/usr/bin/env python
"""Ours beside llama.cpp on models of real sizes, in the formats people download, in one run.

Per model (scripts/make_real_models.py's shapes: random weights, real shapes) and format, each
system in turn, medians of ``--repeats``:

- one stream: decode tok/s at batch 1 (a ``--prompt-len`` prompt, ``--output-len`` tokens:
  (output_len - 1) / (full - first-token time)), and its fraction of the bandwidth bound (the
  machine's read rate, probed just before each repeat, / the bytes one decode step reads: the
  GGUF's tensors as stored; the median over the repeats);
- 8 and 32 concurrent requests (``--concurrency``): output tok/s, all sent at once;
- prefill at 512 and 2048 tokens (``--prefill-lens``): prompt tok/s of a fresh random prompt
  with one token out (wall time: the first token's sampling included, for both);
- start-up: until the engine answers (AsyncEngine started / llama-server's /health); in the
  full run ours is timed in this process, its imports already done.

``--startup-only`` measures start-up alone, each start a process of its own, the systems taking
turns (ours, then llama.cpp in each mode, then back; medians of ``--repeats``; each ratio against
llama.cpp's best mode). Ours runs scripts/startup_probe.py, which reports the interpreter's start
and its imports (torch alone is ~1.3 s) apart from the model's load: the load is the figure set
beside llama-server's process-to-``/health`` time (llama-server has no import phase), and
process-to-ready, all of it, is shown too. After each start, a ``--prompt-len``-token request
with one token out, then a second: the first request's latency beside the second's shows any
work a start deferred to it, beside llama.cpp's; then a ``--output-len`` stream at once and
another once that work is done (decode tok/s of each).

asyncengine runs in this process (one engine per model and format, its prefix cache never hit:
every timed prompt is new, except the stream's repeats, where only the decode is counted);
llama.cpp as ``llama-server`` (scripts/peers/llamacpp/): ``-np 1`` for the stream and prefill,
``-np N`` for N concurrent requests, once with its weights repacked at load (its default) and once
as stored (``--no-repack``; ``--llamacpp-modes``): which is faster depends on the CPU and the
figure, and each ratio is against the faster. ``--interleave-concurrent`` keeps ours and a server
per mode loaded for the concurrent case and times them in turn, repeat by repeat (who goes first
rotating), so drift of the host lands on every side; the ratio is then the median of each
repeat's ratio against llama.cpp's faster mode in that repeat. Prints a table, writes JSON
(``--out``).

    .venv/bin/python scripts/bench_real_sizes.py                                  # everything
    .venv/bin/python scripts/bench_real_sizes.py --models llama-3.2-1b --formats Q4_K_M \\
        --repeats 2 --out /tmp/real_sizes.json                                    # a short run
    .venv/bin/python scripts/bench_real_sizes.py --systems asyncengine --models tiny-llama \\
        --formats hf                                                              # no llama.cpp
    .venv/bin/python scripts/bench_real_sizes.py --startup-only --models llama-3.2-1b \\
        --formats Q4_K_M --repeats 5                                              # start-up alone

Models are made first where missing (make_real_models.py; a 3B takes minutes). A format
``hf`` is the bfloat16 HF directory (asyncengine only: llama.cpp reads GGUF).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: systems, peers

import make_real_models as models
from bench_single_stream import (
    READ_PROBE_MIB,
    bound_tokens_per_second,
    gguf_weight_bytes,
    read_rate,
    weight_bytes,
)
from peers.llamacpp import launcher as peer_llamacpp
from systems import (
    WARMUP_PROMPT,
    build_cpu_kernels,
    cell,
    decode_tokens_per_second,
    finish,
    greedy,
    require_peers,
    stream_repeats,
)

from asyncengine.common.config import EngineConfig, key_value
from asyncengine.script_main import run_main

SYSTEMS = ("asyncengine", "llamacpp")


@dataclass(frozen=True, slots=True)
class Plan:
    """What each system runs on each model (the same for both)."""

    prompt_len: int
    output_len: int
    repeats: int
    concurrency: tuple[int, ...]
    concurrent_prompt_len: int
    concurrent_output_len: int
    prefill_lens: tuple[int, ...]
    seed: int
    read_probe_mib: int = READ_PROBE_MIB  # the read-rate probe before each stream repeat

    @property
    def context(self) -> int:
        """Tokens one sequence may hold: the longest prefill (+1 out), the stream or a concurrent
        request."""
        return max(
            max(self.prefill_lens, default=0) + 2,
            self.prompt_len + self.output_len + 1,
            self.concurrent_prompt_len + self.concurrent_output_len + 1,
        )


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    """Ids drawn from the tokenizer's own range (below 49,152: the padded ids of a larger vocab
    are tokens no text encodes to)."""
    import numpy as np

    high = min(vocab, 49152)
    return [int(t) for t in np.random.default_rng(seed).integers(3, high, size=length)]


def concurrent_prompts(plan: Plan, vocab: int, n: int, repeat: int) -> list[list[int]]:
    base = plan.seed * 1_000_003 + n * 1009 + repeat * 101
    return [random_prompt(vocab, plan.concurrent_prompt_len, base + i) for i in range(n)]


def prefill_prompt(plan: Plan, vocab: int, length: int, repeat: int) -> list[int]:
    return random_prompt(vocab, length, plan.seed * 7919 + length * 31 + repeat + 1)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


# -- asyncengine -----------------------------------------------------------------------------


def engine_config(model: Path, plan: Plan, engine_args: Sequence[tuple[str, Any]]) -> EngineConfig:
    busiest = max(plan.concurrency, default=1) * (
        plan.concurrent_prompt_len + plan.concurrent_output_len
    )
    settings: dict[str, Any] = {
        "model": str(model),
        "device": "cpu",
        "log_interval": 0.0,
        "max_model_len": plan.context,
        # room for the busiest step and the longest prompt, not the 32k-token default
        "kv_cache_tokens": max(busiest, plan.context) + 256,
    }
    return EngineConfig.from_toml(None, **{**settings, **dict(engine_args)})


async def together(engine: Any, prompts: list[list[int]], output_len: int) -> float:
    """Wall seconds of ``prompts`` sent to our engine at once, ``output_len`` greedy tokens each."""
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, greedy(output_len)) for p in prompts))
    seconds = time.perf_counter() - start
    if any(len(out.token_ids) != output_len for out in outs):
        raise RuntimeError("asyncengine gave fewer tokens than asked")
    return seconds


def concurrent_server(
    gguf: Path,
    plan: Plan,
    n: int,
    threads: int | None,
    extra_args: tuple[str, ...],
    log_path: Path | None = None,
) -> peer_llamacpp.LlamaServer:
    """An ``-np n`` llama-server whose slots each hold one concurrent request."""
    return peer_llamacpp.LlamaServer(
        gguf,
        parallel=n,
        threads=threads,
        context_per_slot=plan.concurrent_prompt_len + plan.concurrent_output_len + 8,
        log_path=log_path,
        extra_args=extra_args,
        as_stored_fallback=False,  # --llamacpp-modes chose the layout
    )


async def run_asyncengine(config: EngineConfig, plan: Plan, vocab: int) -> dict[str, Any]:
    from asyncengine.api.engine import AsyncEngine

    started = time.perf_counter()
    async with AsyncEngine(config) as engine:
        startup = time.perf_counter() - started
        await engine.generate(WARMUP_PROMPT, greedy(4))
        await engine.one_time_work_done()  # start-up's deferred work (huge pages, panels): untimed
        prompt = random_prompt(vocab, plan.prompt_len, plan.seed)

        async def stream(n: int) -> Any:
            out = await engine.generate(prompt, greedy(n))
            if len(out.token_ids) != n:
                raise RuntimeError(f"asyncengine gave {len(out.token_ids)} of {n} tokens")
            return out

        await stream(8)  # warm-up of the stream's own shapes
        firsts, fulls, reads = await probed_stream_repeats(stream, plan)

        concurrent = {}
        for n in plan.concurrency:
            seconds = [
                await together(
                    engine, concurrent_prompts(plan, vocab, n, r), plan.concurrent_output_len
                )
                for r in range(plan.repeats)
            ]
            concurrent[str(n)] = n * plan.concurrent_output_len / median(seconds)
        prefill = {}
        for length in plan.prefill_lens:
            seconds = [
                await together(engine, [prefill_prompt(plan, vocab, length, r)], 1)
                for r in range(plan.repeats)
            ]
            prefill[str(length)] = length / median(seconds)
    return {
        "startup_seconds": startup,
        "decode_tokens_per_second": decode_tokens_per_second(plan.output_len, firsts, fulls),
        "concurrent_output_tokens_per_second": concurrent,
        "prefill_tokens_per_second": prefill,
        "stream_first_token_seconds": firsts,
        "stream_full_seconds": fulls,
        "stream_read_bytes_per_second": reads,
    }


async def probed_stream_repeats(
    stream: Callable[[int], Awaitable[Any]], plan: Plan
) -> tuple[list[float], list[float], list[float]]:
    """``stream_repeats`` of ``plan.output_len`` tokens, the machine's read rate probed (bytes a
    second) before each repeat: first-token and full seconds, and the rates."""
    reads: list[float] = []
    firsts, fulls, _ = await stream_repeats(
        stream,
        plan.output_len,
        plan.repeats,
        lambda: reads.append(read_rate(plan.read_probe_mib)),
    )
    return firsts, fulls, reads


# -- llama.cpp -------------------------------------------------------------------------------


def run_llamacpp(
    gguf: Path, plan: Plan, vocab: int, threads: int | None, extra_args: tuple[str, ...] = ()
) -> dict[str, Any]:
    import aiohttp

    folder = Path(tempfile.mkdtemp(prefix="bench_real_sizes_llamacpp_"))
    timeout = aiohttp.ClientTimeout(total=None)

    async def stream_and_prefill(server: peer_llamacpp.LlamaServer) -> dict[str, Any]:
        prompt = random_prompt(vocab, plan.prompt_len, plan.seed)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await server.complete(session, prompt, 8)  # warm-up

            async def stream(n: int) -> Any:
                return await server.complete(session, prompt, n)

            firsts, fulls, reads = await probed_stream_repeats(stream, plan)
            prefill = {}
            for length in plan.prefill_lens:
                seconds = []
                for r in range(plan.repeats):
                    start = time.perf_counter()
                    await server.complete(session, prefill_prompt(plan, vocab, length, r), 1)
                    seconds.append(time.perf_counter() - start)
                prefill[str(length)] = length / median(seconds)
        return {
            "decode_tokens_per_second": decode_tokens_per_second(plan.output_len, firsts, fulls),
            "prefill_tokens_per_second": prefill,
            "stream_first_token_seconds": firsts,
            "stream_full_seconds": fulls,
            "stream_read_bytes_per_second": reads,
        }

    single = peer_llamacpp.LlamaServer(
        gguf,
        parallel=1,
        threads=threads,
        context_per_slot=plan.context,
        log_path=folder / "llama-server-np1.log",
        extra_args=extra_args,
        as_stored_fallback=False,  # --llamacpp-modes chose the layout
    )
    print(f"llamacpp: {' '.join(single.command)}", flush=True)
    with single:
        row = asyncio.run(stream_and_prefill(single))
    row["startup_seconds"] = single.startup_seconds
    row["peak_rss_bytes"] = single.peak_rss_bytes
    concurrent = {}
    for n in plan.concurrency:
        log = folder / f"llama-server-np{n}.log"
        with concurrent_server(gguf, plan, n, threads, extra_args, log) as server:
            seconds = []
            for r in range(plan.repeats):
                requests = [
                    (p, plan.concurrent_output_len) for p in concurrent_prompts(plan, vocab, n, r)
                ]
                _, wall = asyncio.run(peer_llamacpp.run_requests(server, requests))
                seconds.append(wall)
        concurrent[str(n)] = n * plan.concurrent_output_len / median(seconds)
    row["concurrent_output_tokens_per_second"] = concurrent
    row["logs"] = str(folder)
    return row


# -- start-up alone (--startup-only) -------------------------------------------------------

PROBE = Path(__file__).resolve().parent / "startup_probe.py"
STARTUP_FIGURES = (
    "interpreter_seconds",
    "imports_seconds",
    "load_seconds",
    "process_to_ready_seconds",
    "first_request_seconds",
    "second_request_seconds",
    "stream_at_start_tokens_per_second",
    "stream_settled_tokens_per_second",
)


def add_stream_rates(row: dict[str, Any], stream_len: int) -> dict[str, Any]:
    """A start's two streams as decode tok/s: (stream_len - 1) tokens in the stream's seconds
    less a one-token request's (the second: a fresh prompt of the same length)."""
    for key in ("stream_at_start", "stream_settled"):
        gap = row[f"{key}_seconds"] - row["second_request_seconds"]
        row[f"{key}_tokens_per_second"] = (stream_len - 1) / gap if gap > 0 else math.nan
    return row


def start_asyncengine(
    config: EngineConfig, engine_args: Sequence[tuple[str, Any]], prompt_len: int, stream_len: int
) -> dict[str, Any]:
    """One cold start of ours in a process of its own (scripts/startup_probe.py), with the run's
    ``--engine-arg`` keys."""
    settings = {
        "device": config.device,
        "log_interval": config.log_interval,
        "max_model_len": config.max_model_len,
        "kv_cache_tokens": config.kv_cache_tokens,
        **dict(engine_args),
    }
    command = [
        sys.executable,
        str(PROBE),
        str(config.model),
        "--config-json",
        json.dumps(settings),
        "--prompt-len",
        str(prompt_len),
        "--stream-len",
        str(stream_len),
        "--spawned-at",
        repr(time.time()),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"startup_probe.py failed ({done.returncode}): {done.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(lines[-1])
    return add_stream_rates(row, stream_len)


def start_llamacpp(
    gguf: Path, plan: Plan, vocab: int, threads: int | None, extra_args: tuple[str, ...]
) -> dict[str, Any]:
    """One cold start of llama-server (-np 1), timed to /health, then two one-token requests and
    two streams of ``plan.output_len`` tokens (as startup_probe.py sends ours)."""
    import aiohttp

    server = peer_llamacpp.LlamaServer(
        gguf,
        parallel=1,
        threads=threads,
        context_per_slot=plan.context,
        extra_args=extra_args,
        as_stored_fallback=False,  # --llamacpp-modes chose the layout
        poll_seconds=0.01,  # its start-up is under a second: 0.2 s probes would blur it
    )

    async def requests() -> list[float]:
        timeout = aiohttp.ClientTimeout(total=None)
        seconds = []
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for offset, n in (
                (1000, 1),
                (20000, 1),
                (30000, plan.output_len),
                (35000, plan.output_len),
            ):
                prompt = [3 + (offset + i) % min(vocab, 40000) for i in range(plan.prompt_len)]
                start = time.perf_counter()
                await server.complete(session, prompt, n)
                seconds.append(time.perf_counter() - start)
        return seconds

    with server:
        first, second, at_start, settled = asyncio.run(requests())
    row = {
        "interpreter_seconds": 0.0,
        "imports_seconds": 0.0,
        "load_seconds": server.startup_seconds,
        "process_to_ready_seconds": server.startup_seconds,
        "first_request_seconds": first,
        "second_request_seconds": second,
        "stream_at_start_seconds": at_start,
        "stream_settled_seconds": settled,
    }
    return add_stream_rates(row, plan.output_len)


def bench_startup(
    name: str,
    fmt: str,
    path: Path,
    plan: Plan,
    systems: Sequence[str],
    threads: int | None,
    engine_args: Sequence[tuple[str, Any]],
    llamacpp_args: tuple[str, ...] = (),
    modes: Sequence[str] = tuple(peer_llamacpp.SERVER_REPACK_MODES),
) -> dict[str, Any]:
    """``--repeats`` cold starts per system (llama.cpp once per mode), taking turns; medians and
    each start."""
    vocab = vocab_size(path)
    runs = ["asyncengine"] if "asyncengine" in systems else []
    if "llamacpp" in systems and path.suffix == ".gguf":
        runs += [f"llamacpp {mode}" for mode in modes]
    starts: dict[str, list[dict[str, Any]]] = {system: [] for system in runs}
    for repeat in range(plan.repeats):
        for system in runs if repeat % 2 == 0 else list(reversed(runs)):
            load = os.getloadavg()[0]
            if system == "asyncengine":
                config = engine_config(path, plan, engine_args)
                row = start_asyncengine(config, engine_args, plan.prompt_len, plan.output_len)
            else:
                mode = peer_llamacpp.SERVER_REPACK_MODES[system.removeprefix("llamacpp ")]
                row = start_llamacpp(path, plan, vocab, threads, llamacpp_args + mode)
            row["load_average"] = load
            starts[system].append(row)
            print(f"{name} {fmt} {system} start {repeat + 1}: {startup_summary(row)}", flush=True)
    entry: dict[str, Any] = {"model": name, "format": fmt, "path": str(path), "runs": {}}
    for system, rows in starts.items():
        entry["runs"][system] = {
            **{key: median([row[key] for row in rows]) for key in STARTUP_FIGURES},
            "starts": rows,
        }
    return entry


def startup_summary(row: dict[str, Any]) -> str:
    return (
        f"interpreter {row['interpreter_seconds']:.2f} s, imports {row['imports_seconds']:.2f} s, "
        f"load {row['load_seconds']:.2f} s (process to ready {row['process_to_ready_seconds']:.2f}"
        f" s); first request {row['first_request_seconds']:.3f} s, second "
        f"{row['second_request_seconds']:.3f} s; a stream at start "
        f"{row['stream_at_start_tokens_per_second']:.1f} tok/s, settled "
        f"{row['stream_settled_tokens_per_second']:.1f}"
    )


def over_best(
    ours: dict[str, Any], peers: Sequence[dict[str, Any]], key: str, higher: bool = False
) -> str:
    """Ours over llama.cpp's best mode in one start-up figure (the lowest time, or the highest
    rate where ``higher``), as a table cell."""
    values = [row[key] for row in peers if row[key] and not math.isnan(row[key])]
    if not values:
        return ""
    return cell(ours[key] / (max if higher else min)(values), "{:.2f}x")


def startup_table(result: dict[str, Any]) -> str:
    header = [
        "model", "format", "system", "interpreter s", "imports s", "load s",
        "process to ready s", "1st request s", "2nd request s", "stream at start tok/s",
        "settled tok/s",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    for entry in result["entries"]:
        runs = entry["runs"]
        for system, row in runs.items():
            cells = [entry["model"], entry["format"], system]
            cells += [cell(row[key], "{:.2f}") for key in STARTUP_FIGURES[:4]]
            cells += [cell(row[key], "{:.3f}") for key in STARTUP_FIGURES[4:6]]
            cells += [cell(row[key], "{:.1f}") for key in STARTUP_FIGURES[6:]]
            lines.append("| " + " | ".join(cells) + " |")
        peers = [row for system, row in runs.items() if system.startswith("llamacpp")]
        if "asyncengine" in runs and peers:
            ours = runs["asyncengine"]
            cells = [entry["model"], entry["format"], "**ours / llama.cpp's best**", "", ""]
            cells += [over_best(ours, peers, key) for key in STARTUP_FIGURES[2:5]]
            cells += [""]
            cells += [over_best(ours, peers, key, higher=True) for key in STARTUP_FIGURES[6:]]
            lines.append("| " + " | ".join(cells) + " |")
    plan = result["plan"]
    lines.append(
        f"\nmedians of {plan['repeats']} cold starts each, the systems taking turns; ours: "
        "interpreter and imports (torch, asyncengine) apart from the load, the load set beside "
        f"llama-server's process-to-/health time; requests: {plan['prompt_len']}-token prompt, "
        f"1 token out, the first sent once ready; then a stream of {plan['output_len']} tokens "
        "(decode tok/s), and another once ours has done what its start left (huge pages, int8 "
        "panels)"
    )
    return "\n".join(lines)


# -- one model, one format -------------------------------------------------------------------


def step_bytes(path: Path) -> dict[str, Any]:
    """Bytes one decode step reads: a GGUF's tensors as stored, an HF dir's in bfloat16."""
    if path.suffix == ".gguf":
        return gguf_weight_bytes(path)
    return {**weight_bytes(path, "bfloat16"), "stored_as": "bfloat16"}


def vocab_size(path: Path) -> int:
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(path)
        arch = str(reader.fields["general.architecture"].contents())
        field = reader.fields.get(f"{arch}.vocab_size")
        if field is not None:
            return int(field.contents())
        return len(reader.fields["tokenizer.ggml.tokens"].contents())
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return int(config["vocab_size"])


def bench_one(
    name: str,
    fmt: str,
    path: Path,
    plan: Plan,
    systems: Sequence[str],
    threads: int | None,
    engine_args: Sequence[tuple[str, Any]],
    llamacpp_args: tuple[str, ...] = (),
    interleave: bool = False,
    modes: Sequence[str] = tuple(peer_llamacpp.SERVER_REPACK_MODES),
) -> dict[str, Any]:
    vocab = vocab_size(path)
    entry: dict[str, Any] = {
        "model": name,
        "format": fmt,
        "path": str(path),
        "weights": step_bytes(path),
        "runs": {},
    }
    both = "asyncengine" in systems and "llamacpp" in systems and path.suffix == ".gguf"
    together = interleave and both and bool(plan.concurrency)
    # interleaved, the concurrent case runs apart from each system's own run
    own_plan = replace(plan, concurrency=()) if together else plan
    config = engine_config(path, plan, engine_args)
    if "asyncengine" in systems:
        entry["runs"]["asyncengine"] = asyncio.run(run_asyncengine(config, own_plan, vocab))
    if "llamacpp" in systems and path.suffix == ".gguf":
        for mode in modes:
            args = llamacpp_args + peer_llamacpp.SERVER_REPACK_MODES[mode]
            entry["runs"][f"llamacpp {mode}"] = run_llamacpp(path, own_plan, vocab, threads, args)
    if together:
        timed = asyncio.run(
            interleaved_concurrent(config, path, plan, vocab, threads, llamacpp_args, modes)
        )
        for system, seconds in timed["seconds"].items():
            entry["runs"][system]["concurrent_output_tokens_per_second"] = {
                n: plan.concurrent_output_len * int(n) / median(walls)
                for n, walls in seconds.items()
            }
        entry["interleaved_concurrent"] = timed
    for system, row in entry["runs"].items():
        print(f"{name} {fmt} {system}: {summary(row)}", flush=True)
    return entry


async def interleaved_concurrent(
    config: EngineConfig,
    gguf: Path,
    plan: Plan,
    vocab: int,
    threads: int | None,
    extra_args: tuple[str, ...],
    modes: Sequence[str] = ("repacked",),
) -> dict[str, Any]:
    """Per N in ``plan.concurrency``: our engine and an ``-np N`` llama-server per mode
    (``SERVER_REPACK_MODES``) loaded at once, each repeat timing all in turn (who goes first
    rotating repeat by repeat, so that a change of the host's speed lands on every side); wall
    seconds per system, and the median of the repeats' ours-over-llama.cpp throughput ratios,
    against llama.cpp's faster mode in each repeat and per mode."""
    from asyncengine.api.engine import AsyncEngine

    theirs = [f"llamacpp {mode}" for mode in modes]
    seconds: dict[str, dict[str, list[float]]] = {name: {} for name in ["asyncengine", *theirs]}
    ratios: dict[str, float] = {}
    by_mode: dict[str, dict[str, float]] = {mode: {} for mode in modes}
    async with AsyncEngine(config) as engine:
        await engine.generate(WARMUP_PROMPT, greedy(4))
        await engine.one_time_work_done()

        out_len = plan.concurrent_output_len
        for n in plan.concurrency:
            with contextlib.ExitStack() as stack:
                servers = {
                    name: stack.enter_context(
                        concurrent_server(
                            gguf,
                            plan,
                            n,
                            threads,
                            extra_args + peer_llamacpp.SERVER_REPACK_MODES[m],
                        )
                    )
                    for name, m in zip(theirs, modes, strict=True)
                }
                warm = concurrent_prompts(plan, vocab, n, -1)
                await together(engine, warm, out_len)
                for server in servers.values():  # its slots' first prompts, two tokens out
                    await peer_llamacpp.run_requests(server, [(p, 2) for p in warm])
                names = ["asyncengine", *theirs]
                for r in range(plan.repeats):
                    prompts = concurrent_prompts(plan, vocab, n, r)
                    requests = [(p, out_len) for p in prompts]
                    walls: dict[str, float] = {}
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        if name == "asyncengine":
                            walls[name] = await together(engine, prompts, out_len)
                        else:
                            _, walls[name] = await peer_llamacpp.run_requests(
                                servers[name], requests
                            )
                        seconds[name].setdefault(str(n), []).append(walls[name])
                    print(
                        f"{n} at once, repeat {r + 1}: ours {walls['asyncengine']:.2f} s, "
                        + ", ".join(f"{name} {walls[name]:.2f} s" for name in theirs),
                        flush=True,
                    )
            ours = seconds["asyncengine"][str(n)]
            for mode, name in zip(modes, theirs, strict=True):
                pairs = zip(ours, seconds[name][str(n)], strict=True)
                by_mode[mode][str(n)] = median([t / o for o, t in pairs])
            best = [min(seconds[name][str(n)][r] for name in theirs) for r in range(len(ours))]
            ratios[str(n)] = median([t / o for o, t in zip(ours, best, strict=True)])
    return {"seconds": seconds, "ratio_median_of_repeats": ratios, "ratio_by_mode": by_mode}


def summary(row: dict[str, Any]) -> str:
    concurrent = ", ".join(
        f"{n}: {v:.1f}" for n, v in row["concurrent_output_tokens_per_second"].items()
    )
    prefill = ", ".join(f"{n}: {v:.0f}" for n, v in row["prefill_tokens_per_second"].items())
    return (
        f"stream {row['decode_tokens_per_second']:.1f} tok/s; concurrent out tok/s {concurrent}; "
        f"prefill tok/s {prefill}; start-up {row['startup_seconds']:.1f} s"
    )


def stream_reads(result: dict[str, Any]) -> list[float]:
    """Every read-rate probe of the run's streams, bytes/s."""
    return [
        read
        for entry in result["entries"]
        for row in entry["runs"].values()
        for read in row.get("stream_read_bytes_per_second", [])
    ]


def fraction_of_bound(row: dict[str, Any], output_len: int, step_bytes: int) -> float:
    """The median over a stream's repeats of its decode rate over the bound at the read rate
    probed just before it (the rate can change between repeats)."""
    fractions = [
        (output_len - 1) / (full - first) / bound_tokens_per_second(read, step_bytes)
        for first, full, read in zip(
            row.get("stream_first_token_seconds", []),
            row.get("stream_full_seconds", []),
            row.get("stream_read_bytes_per_second", []),
            strict=True,
        )
        if full > first
    ]
    return median(fractions)


def add_bounds(result: dict[str, Any]) -> None:
    """Each run's share of the batch-1 bound, and ours over llama.cpp's best mode per figure."""
    output_len = result["plan"]["output_len"]
    for entry in result["entries"]:
        step = entry["weights"]["bytes"]
        reads = [
            r for row in entry["runs"].values() for r in row.get("stream_read_bytes_per_second", [])
        ]
        entry["bound_tokens_per_second"] = (
            bound_tokens_per_second(median(reads), step) if reads else math.nan
        )
        for row in entry["runs"].values():
            row["fraction_of_bound"] = fraction_of_bound(row, output_len, step)
        runs = entry["runs"]
        theirs = [row for name, row in runs.items() if name.startswith("llamacpp")]
        if "asyncengine" in runs and theirs:
            ours = runs["asyncengine"]
            best = max(row["decode_tokens_per_second"] for row in theirs)
            ratios = {"stream": ours["decode_tokens_per_second"] / best}
            for key, label in (
                ("concurrent_output_tokens_per_second", "concurrent_"),
                ("prefill_tokens_per_second", "prefill_"),
            ):
                for n, value in ours[key].items():
                    ratios[label + n] = value / max(row[key][n] for row in theirs)
            for n, ratio in (
                entry.get("interleaved_concurrent", {}).get("ratio_median_of_repeats", {}).items()
            ):
                ratios["concurrent_" + n] = ratio
            fastest_start = min(row["startup_seconds"] for row in theirs)
            ratios["startup"] = ours["startup_seconds"] / fastest_start
            entry["ours_over_llamacpp"] = ratios


def table(result: dict[str, Any]) -> str:
    plan = result["plan"]
    concurrency = [str(n) for n in plan["concurrency"]]
    prefill = [str(n) for n in plan["prefill_lens"]]
    header = (
        ["model", "format", "system", "stream tok/s", "of bound"]
        + [f"{n} conc. out tok/s" for n in concurrency]
        + [f"prefill {n} tok/s" for n in prefill]
        + ["start-up s"]
    )
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * 2 + "---|" + "---:|" * (len(header) - 3),
    ]
    for entry in result["entries"]:
        rows = list(entry["runs"].items())
        ratios = entry.get("ours_over_llamacpp")
        for system, row in rows:
            cells = [
                entry["model"],
                entry["format"],
                system,
                cell(row["decode_tokens_per_second"], "{:.1f}"),
                cell(row["fraction_of_bound"], "{:.0%}"),
                *(
                    cell(row["concurrent_output_tokens_per_second"].get(n), "{:.1f}")
                    for n in concurrency
                ),
                *(cell(row["prefill_tokens_per_second"].get(n), "{:.0f}") for n in prefill),
                cell(row["startup_seconds"], "{:.1f}"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        if ratios:
            cells = [
                entry["model"],
                entry["format"],
                "**ours / llama.cpp's best**",
                cell(ratios["stream"], "{:.2f}x"),
                "",
                *(cell(ratios.get("concurrent_" + n), "{:.2f}x") for n in concurrency),
                *(cell(ratios.get("prefill_" + n), "{:.2f}x") for n in prefill),
                cell(ratios["startup"], "{:.2f}x"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    reads = stream_reads(result)
    rates = f"{min(reads) / 1e9:.0f}-{max(reads) / 1e9:.0f} GB/s" if reads else "none probed"
    lines.append(
        "\nof bound: each stream repeat's decode rate over the read rate probed just before it "
        f"({rates}) / the bytes a decode step reads; "
        f"stream: {plan['prompt_len']}-token prompt, {plan['output_len']} tokens; concurrent: "
        f"{plan['concurrent_prompt_len']} in, {plan['concurrent_output_len']} out each; "
        f"medians of {plan['repeats']}"
        + (
            "; concurrent: both loaded, timed in turn"
            if result.get("interleave_concurrent")
            else ""
        )
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["llama-3.2-1b", "llama-3.2-3b", "qwen2.5-1.5b"],
        choices=sorted(models.SHAPES),
    )  # fmt: skip
    parser.add_argument(
        "--formats",
        nargs="+",
        default=list(models.FORMATS),
        choices=[models.HF_FORMAT, "bf16", *models.FORMATS, *models.EXTRA_FORMATS],
    )
    parser.add_argument("--systems", default="asyncengine,llamacpp", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16, help="the stream's prompt")
    parser.add_argument("--output-len", type=int, default=128, help="the stream's tokens")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--concurrent-prompt-len", type=int, default=64)
    parser.add_argument("--concurrent-output-len", type=int, default=64)
    parser.add_argument("--prefill-lens", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="llama-server -t (default: all)")
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="an asyncengine config key for every run (repeatable), e.g. quantization=none",
    )
    parser.add_argument(
        "--llamacpp-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra llama-server argument (repeatable), e.g. --llamacpp-arg=--no-repack",
    )
    parser.add_argument(
        "--llamacpp-modes",
        nargs="+",
        default=list(peer_llamacpp.SERVER_REPACK_MODES),
        choices=list(peer_llamacpp.SERVER_REPACK_MODES),
        help="llama-server with its weight repacking and/or with the weights as stored (each "
        "figure's ratio is against the faster)",
    )
    parser.add_argument(
        "--interleave-concurrent",
        action="store_true",
        help="time the concurrent case with both systems loaded, in turn each repeat (the "
        "ratio: the median of the repeats' ratios)",
    )
    parser.add_argument(
        "--read-probe-mib",
        type=int,
        default=READ_PROBE_MIB,
        help="MiB the read-rate probe before each stream repeat reads (the bound's rate)",
    )
    parser.add_argument(
        "--startup-only",
        action="store_true",
        help="only start-up: cold starts in processes of their own, by phase, and the first "
        "two requests (the stream, concurrent and prefill cases are not run)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.output_len < 2 or args.repeats < 1 or args.prompt_len < 1:
        raise SystemExit("need --output-len >= 2, --repeats >= 1 and --prompt-len >= 1")
    if any(n < 1 for n in [*args.concurrency, *args.prefill_lens, args.read_probe_mib]):
        raise SystemExit("--concurrency, --prefill-lens and --read-probe-mib take positive numbers")
    systems = [n.strip() for n in args.systems.split(",") if n.strip()]
    if not systems or not set(systems) <= set(SYSTEMS):
        raise SystemExit(f"--systems: choose from {', '.join(SYSTEMS)}, got {args.systems}")
    require_peers(systems)
    build_cpu_kernels(systems)
    plan = Plan(
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        repeats=args.repeats,
        concurrency=tuple(args.concurrency),
        concurrent_prompt_len=args.concurrent_prompt_len,
        concurrent_output_len=args.concurrent_output_len,
        prefill_lens=tuple(args.prefill_lens),
        seed=args.seed,
        read_probe_mib=args.read_probe_mib,
    )
    started = time.time()
    entries = []
    for name in args.models:
        paths = models.make(name, args.formats)
        for fmt in args.formats:
            common = (name, fmt, paths[fmt], plan, systems, args.threads, args.engine_arg)
            if args.startup_only:
                entries.append(
                    bench_startup(*common, tuple(args.llamacpp_arg), args.llamacpp_modes)
                )
            else:
                entries.append(
                    bench_one(
                        *common,
                        tuple(args.llamacpp_arg),
                        args.interleave_concurrent,
                        args.llamacpp_modes,
                    )
                )
    if args.startup_only:
        result = {"mode": "real_sizes_startup", "plan": asdict(plan), "systems": systems}
        result.update(entries=entries, threads=args.threads or os.cpu_count())
        return finish(result, "scripts/bench_real_sizes.py", argv, started, args.out, startup_table)
    result: dict[str, Any] = {
        "mode": "real_sizes",
        "plan": asdict(plan),
        "systems": systems,
        "entries": entries,
        "threads": args.threads or os.cpu_count(),
        "interleave_concurrent": args.interleave_concurrent,
    }
    add_bounds(result)
    return finish(result, "scripts/bench_real_sizes.py", argv, started, args.out, table)


if __name__ == "__main__":
    run_main(main)
