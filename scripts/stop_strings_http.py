"""The whole-request stop-string benchmark over loopback (``bench_stop_strings.py --http``):
what stop strings cost a request end to end, served by ``asyncengine serve``."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from bench_serving import LaunchedServer

from asyncengine.common.sampling_params import MAX_STOP_STRING_LENGTH

FORCED_TEXT = "a"  # one token of the embedded model; every output token is forced to it


def stop_strings() -> list[str]:
    """Fifteen stop strings at the length limit; the first holds back the last 1,023 characters
    of a run of "a" (a match needs the "!" that never comes), the others never match."""
    return ["a" * (MAX_STOP_STRING_LENGTH - 1) + "!"] + [
        chr(ord("b") + i) * MAX_STOP_STRING_LENGTH for i in range(14)
    ]


async def forced_token(session: aiohttp.ClientSession, base_url: str) -> int:
    """The id of ``FORCED_TEXT`` in the served model's vocabulary (from its own tokenizer)."""
    from asyncengine.executor.loader.default_model import tokenizer_dir
    from asyncengine.text.tokenizer import Tokenizer

    async with session.get(base_url + "/v1/models") as response:
        model = (await response.json())["data"][0]["id"]
    ids = Tokenizer(tokenizer_dir(model)).encode(FORCED_TEXT)
    if len(ids) != 1:
        raise SystemExit(f"{FORCED_TEXT!r} is {len(ids)} tokens in {model}; need one")
    return ids[0]


async def one_request(
    session: aiohttp.ClientSession, base_url: str, token: int, tokens: int, stops: list[str]
) -> float:
    body: dict[str, Any] = {
        "prompt": "hello",
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "logit_bias": {str(token): 100},
    }
    if stops:
        body["stop"] = stops
    start = time.perf_counter()
    async with session.post(base_url + "/v1/completions", json=body) as response:
        answer = await response.json()
    seconds = time.perf_counter() - start
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {answer}")
    choice = answer["choices"][0]
    if choice["text"] != FORCED_TEXT * tokens or choice["finish_reason"] != "length":
        raise SystemExit(f"unexpected output: {choice['finish_reason']}, {choice['text'][:80]!r}")
    return seconds


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    base_url: str, tokens: int, repeats: int, server_pid: int | None
) -> dict[str, dict[str, list[float]]]:
    """Wall seconds of each run, and the server's CPU seconds in it when it runs here (less
    sensitive than wall time to the load of a shared machine)."""
    timeout = aiohttp.ClientTimeout(total=3600)
    cases = {"with_stop_strings": stop_strings(), "without": []}
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        token = await forced_token(session, base_url)
        await one_request(session, base_url, token, 16, stop_strings())  # warm-up
        for repeat in range(repeats):
            for name, stops in cases.items():
                cpu_before = None if server_pid is None else process_cpu_seconds(server_pid)
                seconds = await one_request(session, base_url, token, tokens, stops)
                wall[name].append(seconds)
                line = f"  repeat {repeat + 1} {name}: {seconds:.2f} s"
                if server_pid is not None and cpu_before is not None:
                    cpu[name].append(process_cpu_seconds(server_pid) - cpu_before)
                    line += f", server CPU {cpu[name][-1]:.2f} s"
                print(line, flush=True)
    return {"wall_s": wall, "server_cpu_s": cpu}


def run_http(url: str | None, tokens: int, repeats: int, out: Path | None) -> dict[str, Any]:
    """Time the request with and without stop strings; print a table, write JSON."""
    server = None
    pid = None
    if url is None:
        log = Path(tempfile.gettempdir()) / f"bench_stop_strings_serve_{os.getpid()}.log"
        server = LaunchedServer([], startup_timeout=600.0, log_path=log)
        server.start()
        assert server.process is not None
        url, pid = server.base_url, server.process.pid
    try:
        runs = asyncio.run(measure(url, tokens, repeats, pid))
    finally:
        if server is not None:
            server.stop()
    medians = {
        kind: {name: statistics.median(values) for name, values in by_name.items() if values}
        for kind, by_name in runs.items()
    }
    ratios = {
        kind: m["with_stop_strings"] / m["without"] for kind, m in medians.items() if len(m) == 2
    }
    print(f"{tokens} tokens, 15 stop strings of {MAX_STOP_STRING_LENGTH} characters, one held")
    print("| request | wall s (runs) | median wall s | server CPU s (runs) | median CPU s |")
    print("| --- | --- | ---: | --- | ---: |")
    for name in ("with_stop_strings", "without"):
        walls = ", ".join(f"{s:.2f}" for s in runs["wall_s"][name])
        cpus = ", ".join(f"{s:.2f}" for s in runs["server_cpu_s"][name]) or "-"
        cpu_median = medians["server_cpu_s"].get(name)
        cpu_cell = "-" if cpu_median is None else f"{cpu_median:.2f}"
        print(f"| {name} | {walls} | {medians['wall_s'][name]:.2f} | {cpus} | {cpu_cell} |")
    for kind, ratio in ratios.items():
        print(f"ratio with/without ({kind}, medians): {ratio:.3f}")
    report = {
        "benchmark": "stop_strings_http",
        "output_tokens": tokens,
        "stop_strings": len(stop_strings()),
        "stop_length": MAX_STOP_STRING_LENGTH,
        "repeats": repeats,
        "runs": runs,
        "medians": medians,
        "ratios": ratios,
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg()[0],
        },
    }
    out = out or Path("bench_results/bench_stop_strings_http.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report
