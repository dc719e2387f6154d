"""`asyncengine serve` from the command line: --help documents every option, and the README's
curl and `openai`-client examples work as written against it (only the port differs); SIGINT
stops it with exit code 0 after the periodic summary line has been logged."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncengine.cli import add_engine_arguments, main
from asyncengine.common.config import EngineConfig
from asyncengine.server.serve import DEFAULT_HOST, DEFAULT_PORT, add_serve_arguments
from tests.server_support import MAX_MODEL_LEN, server_subprocess, split_sse, tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_BASE = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
# what the issue names explicitly; every other option is checked too
REQUIRED_OPTIONS = ("--config", "--model", "--host", "--port", "--policy", "--api-key")


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    add_serve_arguments(parser)
    return parser


def server_section() -> str:
    """The README's server examples: "## Talk to the server" up to its first subsection."""
    text = README.read_text()
    start = text.index("## Talk to the server")
    end = min(text.index("\n## ", start + 1), text.index("\n### ", start + 1))
    return text[start:end]


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", server_section(), flags=re.S)


def curl_commands() -> list[dict[str, Any]]:
    """The README's curl commands as {url, headers, body}; fails on a flag it does not know."""
    (block,) = code_blocks("bash")
    words = shlex.split(block)
    commands: list[dict[str, Any]] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "curl":
            commands.append({"url": None, "headers": {}, "body": None})
        elif word in ("-s", "-N", "-sN"):
            pass  # silent / no buffering: nothing to replay
        elif word == "-H":
            name, _, value = words[i + 1].partition(":")
            commands[-1]["headers"][name.strip()] = value.strip()
            i += 1
        elif word == "-d":
            commands[-1]["body"] = words[i + 1]
            i += 1
        elif word.startswith("http"):
            commands[-1]["url"] = word
        else:
            raise AssertionError(f"README curl word {word!r} is not understood by this test")
        i += 1
    return commands


def test_serve_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    options = [
        (action.option_strings[0], action.help)
        for action in serve_parser()._actions
        if action.option_strings and action.option_strings[0] != "-h"
    ]
    assert {name for name, _ in options} >= set(REQUIRED_OPTIONS)
    undocumented = [name for name, help_text in options if not (help_text and help_text.strip())]
    assert undocumented == []
    missing = [name for name, _ in options if name not in text]
    assert missing == []


def test_admin_token_help_names_every_route_it_guards(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.server.admin import ADMIN_PATHS, ADMIN_PREFIX
    from asyncengine.server.app import create_app
    from asyncengine.server.sglang_worker import FLUSH_PATH
    from tests.server_support import engine_config

    engine = AsyncEngine(engine_config(tiny_model_dir(tmp_path_factory)))  # never started
    app = create_app(engine, admin_token="t")
    guarded = {
        route.resource.canonical
        for route in app.router.routes()
        if route.resource is not None
        and (
            route.resource.canonical.startswith(ADMIN_PREFIX)
            or route.resource.canonical in {*ADMIN_PATHS, FLUSH_PATH}
        )
    }
    assert len(guarded) >= 6
    (action,) = [a for a in serve_parser()._actions if "--admin-token" in a.option_strings]
    assert action.help is not None
    assert sorted(p for p in guarded if p not in action.help) == []


def test_readme_examples_match_the_defaults() -> None:
    """`make serve` serves the default model on the default address: what the README talks to."""
    commands = curl_commands()
    assert len(commands) == 2
    assert all(c["url"].startswith(README_BASE + "/") for c in commands)
    assert json.loads(commands[0]["body"])["model"] == EngineConfig().model
    (python,) = [b for b in code_blocks("python") if "from openai import OpenAI" in b]
    assert f'base_url="{README_BASE}/v1"' in python
    assert f'model="{EngineConfig().model}"' in python


@pytest.mark.slow
@pytest.mark.asyncio
async def test_cli_serve_answers_the_readme_examples_and_stops_on_sigint(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    async with server_subprocess(
        "-m", "asyncengine.cli", "serve",
        "--model", str(model), "--served-model-name", EngineConfig().model,
        "--dtype", "float32", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-tokens", "4096", "--log-interval", "0",
        "--port", "0", "--server-log-interval", "0.2",
    ) as server:  # fmt: skip
        proc, lines = server.proc, server.lines
        base = f"http://127.0.0.1:{server.port}"
        chat, native = curl_commands()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            url = chat["url"].replace(README_BASE, base)
            async with session.post(url, data=chat["body"], headers=chat["headers"]) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
            assert body["object"] == "chat.completion"
            assert isinstance(body["choices"][0]["message"]["content"], str)
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
            assert 1 <= body["usage"]["completion_tokens"] <= 32
            url = native["url"].replace(README_BASE, base)
            async with session.post(url, data=native["body"], headers=native["headers"]) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                frames = [json.loads(p) for p in split_sse(await resp.read())[:-1]]
            assert frames[-1]["meta_info"]["finish_reason"]["type"] in ("stop", "length")
            assert frames[-1]["meta_info"]["prompt_tokens"] > 0
        (python,) = [b for b in code_blocks("python") if "from openai import OpenAI" in b]
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", python.replace(README_BASE, base),
            cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(client.communicate(), 120)
        assert client.returncode == 0, err.decode()[-2000:]
        assert out.strip(), err.decode()[-2000:]
        summary = re.compile(
            r"running=\d+ waiting=\d+ http_requests=\d+ gen_tok/s=[\d.]+ prompt_tok/s=[\d.]+ "
            r"cache_hit=[\d.]+% kv_pages used=\d+ cached=\d+ total=\d+"
        )

        def served() -> int:
            """Requests the summary lines so far have counted."""
            counts = (re.search(r"http_requests=(\d+)", line) for line in lines)
            return sum(int(m.group(1)) for m in counts if m and summary.search(m.string))

        for _ in range(300):  # the summary line that counts the last request (0.2 s interval)
            if served() >= 3:
                break
            await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await asyncio.wait_for(server.reader, 10)
        log = "\n".join(lines)
        assert "server stopped" in log, log[-2000:]
        summaries = [line for line in lines if summary.search(line)]
        assert summaries, log[-2000:]
        # the requests above show up in the summaries: three served, tokens generated
        assert served() == 3
        assert any(not re.search(r"gen_tok/s=0\.0 ", s) for s in summaries)
