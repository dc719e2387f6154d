"""serve(): a real server process on uvloop. SIGTERM closes the listener (a new connection, a
health probe's too, is refused), lets in-flight streams finish within the grace period, aborts
the rest (their streams still end with a final chunk and [DONE]), stops the engine and exits 0;
the periodic log line is written."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
from pathlib import Path

import aiohttp
import pytest

from asyncengine.server.serve import drain
from tests.server_support import (
    engine_config,
    server_subprocess,
    split_sse,
    start_server,
    tiny_model_dir,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]

SERVER_SCRIPT = """
import logging, sys, argparse
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from asyncengine.common.config import EngineConfig
from asyncengine.server.serve import add_serve_arguments, serve
parser = argparse.ArgumentParser()
add_serve_arguments(parser)
args = parser.parse_args(sys.argv[2:])
config = EngineConfig(model=sys.argv[1], dtype="float32", device="cpu", max_model_len=8192,
                      kv_cache_tokens=16384, log_interval=0)
sys.exit(serve(config, args))
"""


async def _stream(
    session: aiohttp.ClientSession, url: str, max_tokens: int
) -> tuple[bytes, asyncio.Task[bytes]]:
    """Start a streaming completion; return its first bytes and a task reading the rest."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    resp = await session.post(url, json=body)
    assert resp.status == 200
    first = await resp.content.readany()

    async def rest() -> bytes:
        try:
            return await resp.read()
        finally:
            resp.release()

    return first, asyncio.create_task(rest())


async def _refused(url: str, tries: int = 200) -> bool:
    """Whether a new connection to ``url`` is refused within ``tries`` attempts."""
    for _ in range(tries):
        try:
            async with aiohttp.ClientSession() as session, session.get(url) as resp:
                await resp.read()
        except aiohttp.ClientConnectionError:
            return True
        await asyncio.sleep(0.01)
    return False


def _finish_reason(raw: bytes) -> str:
    chunks = [json.loads(p) for p in split_sse(raw)[:-1]]
    return chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_sigterm_drains_then_aborts_and_exits_zero(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    async with server_subprocess(
        "-c", SERVER_SCRIPT, str(model),
        "--port", "0", "--shutdown-grace", "2", "--server-log-interval", "0.2",
    ) as server:  # fmt: skip
        proc, port = server.proc, server.port
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            # a short request that ends within the grace period, a long one that cannot
            short_head, short_rest = await _stream(session, url, 4)
            long_head, long_rest = await _stream(session, url, 8000)
            proc.send_signal(signal.SIGTERM)
            # the listener closes at once: a health probe is refused while the streams drain
            assert await _refused(f"http://127.0.0.1:{port}/health")
            assert not long_rest.done()
            short_raw = short_head + await short_rest
            long_raw = long_head + await long_rest
        assert _finish_reason(short_raw) == "length"
        assert _finish_reason(long_raw) == "abort"
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await asyncio.wait_for(server.reader, 10)
        log = "\n".join(server.lines)
        assert (
            "shutting down" in log
            and "grace period over: aborting 1" in log
            and "server stopped" in log
        )
        assert re.search(r"running=\d+ waiting=\d+ http_requests=\d+ gen_tok/s=", log), log[-2000:]
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as session:
                await session.get(f"http://127.0.0.1:{port}/health")


@pytest.mark.slow
@pytest.mark.asyncio
async def test_short_grace_with_many_streams_logs_no_unhandled_errors(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Our grace period and aiohttp's own shutdown timeout must not fire together: that raced
    into ``Unhandled exception ... InvalidStateError`` lines at the deadline."""
    model = tiny_model_dir(tmp_path_factory)
    async with server_subprocess(
        "-c", SERVER_SCRIPT, str(model), "--port", "0", "--shutdown-grace", "0.3",
    ) as server:  # fmt: skip
        proc, port = server.proc, server.port
        url = f"http://127.0.0.1:{port}/v1/completions"
        # no total deadline (ten long streams start one after another on a busy machine), but a
        # stream the server leaves hanging fails after 60 s without a byte
        timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            streams = [await _stream(session, url, 8000) for _ in range(10)]
            proc.send_signal(signal.SIGTERM)
            raws = [head + await rest for head, rest in streams]
        assert [_finish_reason(raw) for raw in raws] == ["abort"] * 10
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await asyncio.wait_for(server.reader, 10)
        log = "\n".join(server.lines)
        assert "grace period over: aborting 10" in log and "server stopped" in log, log[-3000:]
        for bad in ("Unhandled exception", "InvalidStateError", "Traceback", "Error handling"):
            assert bad not in log, log[-3000:]


@pytest.mark.asyncio
async def test_the_grace_period_aborts_and_counts_the_queued_requests_too(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncengine.server")
    config = engine_config(
        tiny_model_dir(tmp_path_factory), max_running_requests=1, max_model_len=8192
    )
    server = await start_server(config)
    body = {"prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            responses = [
                await session.post(server.base_url + "/v1/completions", json=body) for _ in range(2)
            ]
            stats = server.engine.stats
            assert await wait_until(lambda: stats()["running"] == 1 and stats()["waiting"] == 1)
            await drain(server.runner, server.engine, 0.2)
            for resp in responses:
                assert _finish_reason(await resp.read()) == "abort"
        assert "grace period over: aborting 2 in-flight request(s)" in caplog.text
    finally:
        await server.engine.stop()
