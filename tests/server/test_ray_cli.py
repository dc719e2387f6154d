"""``asyncengine serve --replicas 2`` end to end: a local Ray started and stopped with the
server, the same HTTP API, and a replica killed mid-stream: its streams end cleanly with an
in-band error, the other replica's streams finish, the next requests succeed, Ray Serve
restarts the replica, and SIGTERM takes everything down: a stream still running when the
grace period ends finishes with an abort, as one engine's does."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.ray_support import command_line, descendants
from tests.server_support import server_subprocess, split_sse, tiny_model_dir

pytestmark = pytest.mark.slow

TIMEOUT = aiohttp.ClientTimeout(total=90)
REPLICA = "ServeReplica:asyncengine:AsyncEngineReplica"


def replica_pids(server_pid: int) -> list[int]:
    return sorted(p for p in descendants(server_pid) if REPLICA in command_line(p))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    match = re.search(rf"^{name} (\S+)$", text, flags=re.M)
    return float(match.group(1)) if match else 0.0


async def test_replicas_survive_a_replica_killed_mid_stream(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    async with server_subprocess(
        "-m", "asyncengine.cli", "serve", "--model", str(model),
        "--dtype", "float32", "--device", "cpu", "--max-model-len", "4096",
        "--kv-cache-tokens", "16384", "--log-interval", "0", "--server-log-interval", "0",
        "--port", "0", "--replicas", "2", "--router", "round-robin", "--shutdown-grace", "1",
    ) as server:  # fmt: skip
        base = f"http://127.0.0.1:{server.port}"
        pids = replica_pids(server.proc.pid)
        assert len(pids) == 2, server.lines[-20:]
        long = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            responses = [
                await session.post(
                    f"{base}/generate",
                    json={"text": f"story number {i}", "sampling_params": long, "stream": True},
                )
                for i in range(4)
            ]
            for resp in responses:
                assert resp.status == 200
                assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
            os.kill(pids[0], signal.SIGKILL)
            bodies: list[bytes] = await asyncio.wait_for(
                asyncio.gather(*(r.read() for r in responses)), 60
            )
            endings: list[Any] = []
            for raw in bodies:
                last = split_sse(b"data: {}\n\n" + raw)[-2]  # every stream ends with [DONE]
                endings.append(last)
            failed = [e for e in endings if b'"error"' in e]
            finished = [e for e in endings if b'"type":"length"' in e]
            assert len(failed) == 2 and len(finished) == 2, endings
            assert all(b'"code":"request_failed"' in e and b"error id err-" in e for e in failed)
            # the survivor (and soon the replacement) serve the next requests
            short = {"max_new_tokens": 4, "temperature": 0}
            for i in range(4):
                async with session.post(
                    f"{base}/v1/completions",
                    json={"prompt": f"next {i}", "max_tokens": 4, "temperature": 0},
                ) as resp:
                    assert resp.status == 200, await resp.text()
            for _ in range(300):  # Ray Serve starts a replacement
                if await metric(session, base, "asyncengine_replicas") == 2:
                    break
                await asyncio.sleep(0.2)
            assert await metric(session, base, "asyncengine_replicas") == 2
            async with session.post(
                f"{base}/generate", json={"text": "after", "sampling_params": short}
            ) as resp:
                assert resp.status == 200
        new_pids = replica_pids(server.proc.pid)
        assert len(new_pids) == 2 and pids[0] not in new_pids
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            body = {"prompt": "draining", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
                server.proc.send_signal(signal.SIGTERM)
                frames = split_sse(await resp.read())
            assert frames[-1] == b"[DONE]"
            assert b'"finish_reason":"abort"' in frames[-2], frames[-3:]
        assert await asyncio.wait_for(server.proc.wait(), 90) == 0
        assert not any(alive(p) for p in new_pids)
