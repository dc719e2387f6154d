"""Load test: N concurrent streaming clients against an asyncengine (or any OpenAI) server.

Each client sends streaming requests one after another until the request count or the
duration limit is reached, and checks the SSE framing (``data:`` frames, ``[DONE]`` last).
Reports completed / failed counts and TTFT, ITL and end-to-end latency percentiles.

    python scripts/load_test.py --url http://127.0.0.1:8000 --clients 64 --requests 256
    python scripts/load_test.py --model smollm2-135m --clients 8 --max-tokens 16   # in-process server
    ... --json-out report.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.bench.percentiles import LatencyStats
from asyncengine.script_main import run_main

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jam".split()


@dataclass(slots=True)
class LoadConfig:
    url: str
    clients: int = 64
    requests: int = 64  # in all, shared by the clients
    max_tokens: int = 8
    prompt_words: int = 16
    endpoint: str = "completions"  # completions | chat
    model: str | None = None
    api_key: str | None = None
    duration_limit: float = 120.0  # no new request after this many seconds
    request_timeout: float = 120.0
    seed: int = 0


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    chunks: int = 0
    completion_tokens: int | None = None
    error: str | None = None


@dataclass(slots=True)
class LoadReport:
    clients: int
    completed: int
    failed: int
    not_sent: int
    wall_seconds: float
    requests_per_second: float
    output_tokens_per_second: float
    ttft: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]
    errors: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _stats(values: list[float]) -> dict[str, float | None]:
    return {
        k: (None if isinstance(v, float) and math.isnan(v) else v)
        for k, v in LatencyStats.of(values).to_dict().items()
    }


def _body(cfg: LoadConfig, rng: random.Random) -> dict[str, Any]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(cfg.prompt_words))
    body: dict[str, Any] = {
        "max_tokens": cfg.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.model:
        body["model"] = cfg.model
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _one_request(
    session: aiohttp.ClientSession, cfg: LoadConfig, body: dict[str, Any]
) -> RequestResult:
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last_token_time: float | None = None
    try:
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
        async with session.post(
            cfg.url.rstrip("/") + path, json=body, headers=headers, timeout=timeout
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            buffer = b""
            done = False
            async for data in resp.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        result.error = f"bad SSE frame: {event[:80]!r}"
                        return result
                    payload = event[6:]
                    if done:
                        result.error = "data after [DONE]"
                        return result
                    if payload == b"[DONE]":
                        done = True
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = f"in-band error: {chunk['error']}"
                        return result
                    if chunk.get("usage"):
                        result.completion_tokens = chunk["usage"]["completion_tokens"]
                    choices = chunk.get("choices") or []
                    text = ""
                    if choices:
                        choice = choices[0]
                        text = (
                            choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                        )
                    if text:
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - start
                        elif last_token_time is not None:
                            result.itl.append(now - last_token_time)
                        last_token_time = now
                        result.chunks += 1
            if not done:
                result.error = "stream ended without [DONE]"
                return result
            if buffer.strip():
                result.error = f"trailing bytes after the last frame: {buffer[:80]!r}"
                return result
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    return result


async def run_load(cfg: LoadConfig) -> LoadReport:
    """Run the load; bounded by ``cfg.requests`` and ``cfg.duration_limit``."""
    rng = random.Random(cfg.seed)
    bodies = [_body(cfg, rng) for _ in range(cfg.requests)]
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + cfg.duration_limit

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await _one_request(session, cfg, body))

    connector = aiohttp.TCPConnector(limit=cfg.clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(cfg.clients)))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens if r.completion_tokens is not None else r.chunks for r in ok)
    return LoadReport(
        clients=cfg.clients,
        completed=len(ok),
        failed=len(results) - len(ok),
        not_sent=queue.qsize(),
        wall_seconds=wall,
        requests_per_second=len(ok) / wall if wall else 0.0,
        output_tokens_per_second=tokens / wall if wall else 0.0,
        ttft=_stats([r.ttft for r in ok if r.ttft is not None]),
        itl=_stats([gap for r in ok for gap in r.itl]),
        e2e=_stats([r.e2e for r in ok]),
        errors=sorted({r.error for r in results if r.error})[:10],
    )


async def _run_with_local_server(cfg: LoadConfig, engine_model: str, dtype: str) -> LoadReport:
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.config import EngineConfig
    from asyncengine.server.app import create_app
    from asyncengine.server.serve import start_http

    async with AsyncEngine(EngineConfig(model=engine_model, dtype=dtype, log_interval=0)) as engine:
        runner, port = await start_http(create_app(engine))
        try:
            cfg.url = f"http://127.0.0.1:{port}"
            return await run_load(cfg)
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    where.add_argument(
        "--model", dest="engine_model", help="start an in-process server on this model instead"
    )
    parser.add_argument("--dtype", default="auto", help="dtype of the in-process engine")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--requests", type=int, default=None, help="requests in all (default: one per client)"
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=16)
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--served-model", default=None, help="'model' field to send")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--duration-limit", type=float, default=120.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error("--clients must be >= 1")
    cfg = LoadConfig(
        url=args.url or "",
        clients=args.clients,
        requests=args.requests or args.clients,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        endpoint=args.endpoint,
        model=args.served_model,
        api_key=args.api_key,
        duration_limit=args.duration_limit,
        request_timeout=args.request_timeout,
    )
    if args.url:
        report = asyncio.run(run_load(cfg))
    else:
        report = asyncio.run(_run_with_local_server(cfg, args.engine_model, args.dtype))
    text = report.to_json()
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return 0 if report.failed == 0 and report.not_sent == 0 else 1


if __name__ == "__main__":
    run_main(main)
