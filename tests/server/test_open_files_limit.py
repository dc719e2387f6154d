"""The server raises its soft open-files limit at start (many hosts start processes at 1024,
far below their hard limit), and its default cap on open connections follows the raised limit."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.server.connection_limits import (
    FD_MARGIN,
    MAX_DEFAULT_OPEN_CONNECTIONS,
    OPEN_FILES_TARGET,
)
from tests.server_support import MAX_MODEL_LEN, server_subprocess, tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
LOW_SOFT_LIMIT = 400  # the default cap at this limit: its half, 200


def start_low() -> None:
    """In the child: start with a low soft limit and the hard limit as it is."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_SOFT_LIMIT, hard))


def raised_limit() -> int:
    """What the server raises a low soft limit to under this process's hard limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OPEN_FILES_TARGET if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_TARGET)


def default_cap(soft: int) -> int:
    return min(MAX_DEFAULT_OPEN_CONNECTIONS, max(soft // 2, soft - FD_MARGIN))


def run_started_low(script: str) -> str:
    """What ``script`` prints, run in a process started with the low soft limit."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        preexec_fn=start_low,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_a_process_started_low_raises_its_limit_and_its_cap_follows() -> None:
    script = (
        "import json, resource\n"
        "from asyncengine.server.connection_limits import (\n"
        "    default_max_open_connections, raise_open_files_limit)\n"
        "before = default_max_open_connections()\n"
        "raised = raise_open_files_limit()\n"
        "again = raise_open_files_limit()\n"
        "soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "print(json.dumps([before, raised, again, soft, default_max_open_connections()]))\n"
    )
    before, raised, again, soft, cap = json.loads(run_started_low(script).splitlines()[-1])
    assert before == default_cap(LOW_SOFT_LIMIT) == LOW_SOFT_LIMIT // 2
    assert raised == again == soft == raised_limit() > LOW_SOFT_LIMIT
    assert cap == default_cap(raised_limit())


def test_a_limit_above_the_target_is_not_lowered() -> None:
    script = (
        "import resource\n"
        "from asyncengine.server.connection_limits import raise_open_files_limit\n"
        "print(raise_open_files_limit(target=64), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    assert run_started_low(script).split() == [str(LOW_SOFT_LIMIT)] * 2


@pytest.mark.slow
@pytest.mark.asyncio
async def test_serve_started_with_a_low_limit_raises_it_and_caps_connections_below_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    async with server_subprocess(
        "-m", "asyncengine.cli", "serve",
        "--model", str(model), "--dtype", "float32", "--device", "cpu",
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "1024",
        "--log-interval", "0", "--port", "0",
        preexec_fn=start_low,
    ) as server:  # fmt: skip
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        (soft,) = re.findall(r"Max open files\s+(\d+)", limits)
        assert int(soft) == raised_limit()
        log = "\n".join(server.lines)
        assert f"raised the open-files limit from {LOW_SOFT_LIMIT} to {raised_limit()}" in log
        capped = re.search(r"open connections capped at (\d+)", log)
        assert capped is not None, log[-2000:]
        assert int(capped.group(1)) == default_cap(raised_limit())
        server.proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(server.proc.wait(), 60) == 0
