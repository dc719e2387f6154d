"""How long a plain ``json_object`` request waits after a flood of heavy grammar compiles.

After one small regex request (which starts the server's grammar compiler), sends ``--flood``
distinct regular expressions that take xgrammar about half a second each to
compile, drops each request after ``--drop-after`` seconds (as an impatient client does), then
times one small ``response_format: json_object`` request. Against ``--url`` (a running server),
or a server started here on 127.0.0.1 with ``--model``. Prints a table and one JSON line.

    .venv/bin/python scripts/grammar_flood.py --flood 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp


@dataclass
class FloodResult:
    flood: int
    drop_after: float
    warmup_status: int  # a small regex first: the compiler started, json_object not compiled
    warmup_seconds: float
    flood_dropped: int  # requests still unanswered when dropped
    flood_answered: dict[str, int]  # status -> count of those answered before the drop
    json_object_status: int
    json_object_seconds: float


def heavy_regex(index: int) -> str:
    """A distinct regular expression whose compile takes xgrammar about half a second (its
    caches share work between near-identical ones: the bound itself differs)."""
    return f"[a-z]{{1,{1000 + index}}}[0-9]{{1,1000}}[A-Z]{{1,1000}}[a-f]{{1,1000}}"


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> int:
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


async def flood(
    url: str, count: int = 40, drop_after: float = 0.5, api_key: str | None = None
) -> FloodResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        # the server's grammar compiler is started (xgrammar imported, the vocabulary read:
        # seconds, once per server) by a small grammar that is not json_object
        start = time.perf_counter()
        warm_status = await _post(
            session, url, {"prompt": "x", "max_tokens": 2, "regex": "[0-9]+"}, headers
        )
        warmup = time.perf_counter() - start
        tasks = [
            asyncio.ensure_future(
                _post(
                    session,
                    url,
                    {"prompt": "x", "max_tokens": 4, "regex": heavy_regex(i)},
                    headers,
                )
            )
            for i in range(count)
        ]
        done, pending = await asyncio.wait(tasks, timeout=drop_after) if tasks else (set(), set())
        for task in pending:
            task.cancel()  # the client goes away: its connection closes
        await asyncio.gather(*pending, return_exceptions=True)
        answered: dict[str, int] = {}
        for task in done:
            status = str(task.result()) if task.exception() is None else "error"
            answered[status] = answered.get(status, 0) + 1
        body = {
            "prompt": "Reply in JSON.",
            "max_tokens": 8,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        }
        start = time.perf_counter()
        status = await _post(session, url, body, headers)
        seconds = time.perf_counter() - start
    return FloodResult(
        count, drop_after, warm_status, warmup, len(pending), answered, status, seconds
    )


async def _with_own_server(args: argparse.Namespace) -> FloodResult:
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.config import EngineConfig
    from asyncengine.server.app import create_app
    from asyncengine.server.serve import start_http

    config = EngineConfig(model=args.model, log_interval=0)
    engine = AsyncEngine(config)
    await engine.start()
    runner, port = await start_http(create_app(engine), "127.0.0.1", 0)
    try:
        return await flood(f"http://127.0.0.1:{port}", args.flood, args.drop_after)
    finally:
        await runner.cleanup()
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one here)")
    parser.add_argument(
        "--model", default="smollm2-135m", help="the model of a server started here"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--flood", type=int, default=40, help="heavy regex requests to send")
    parser.add_argument("--drop-after", type=float, default=0.5, help="seconds before dropping")
    args = parser.parse_args()
    if args.url:
        result = asyncio.run(flood(args.url, args.flood, args.drop_after, args.api_key))
    else:
        result = asyncio.run(_with_own_server(args))
    print(
        "| warm-up s | flood | dropped after | dropped | answered | json_object status "
        "| json_object s |"
    )
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    print(
        f"| {result.warmup_seconds:.2f} | {result.flood} | {result.drop_after:g} s | "
        f"{result.flood_dropped} | "
        f"{result.flood_answered} | {result.json_object_status} | "
        f"{result.json_object_seconds:.2f} |"
    )
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
