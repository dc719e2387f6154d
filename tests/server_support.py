"""Helpers of the HTTP server tests: a tiny model, a real engine + server on loopback, SSE parsing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tokenizers import Tokenizer, processors

from asyncengine.common.config import EngineConfig
from asyncengine.server.app import create_app
from asyncengine.server.prometheus import ServerMetrics
from asyncengine.server.serve import start_http
from asyncengine.server.state import STATE

# A random llama small enough to decode hundreds of tokens a second on 2 cores, with the
# default model's tokenizer so that its outputs are words, prompts are real text and the chat
# template is ChatML.
TINY_MODEL: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MAX_MODEL_LEN = 512


def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, **overrides: Any) -> Path:
    """The tiny checkpoint (``TINY_MODEL`` with ``overrides``), written once per test session."""
    suffix = "".join(f"_{key}{value}" for key, value in sorted(overrides.items()))
    target = tmp_path_factory.getbasetemp() / f"server_tiny_llama{suffix}"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from asyncengine.executor.loader import DEFAULT_MODEL, resolve_model

    default_dir = resolve_model(DEFAULT_MODEL, torch.bfloat16)  # converted once, then cached
    staging = tmp_path_factory.mktemp("server_tiny_llama_staging")
    config = LlamaConfig(**{**TINY_MODEL, **overrides})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(staging, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (default_dir / name).is_file():
            shutil.copy(default_dir / name, staging / name)
    staging.rename(target)
    return target


# a template that writes the documents before the conversation (as retrieval templates do)
RAG_TEMPLATE = (
    "{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BOS = "<|im_start|>"


def bos_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer that puts a BOS before a text when asked to add special
    tokens, and RAG_TEMPLATE for its chat template."""
    target = tmp_path_factory.mktemp("tiny_with_bos")
    shutil.copytree(tiny_model_dir(tmp_path_factory), target, dirs_exist_ok=True)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
    )
    tokenizer.save(str(target / "tokenizer.json"))
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").write_text(RAG_TEMPLATE)
    return target


def engine_config(model_dir: Path | str, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "device": "cpu",
        "page_size": 16,
        "kv_cache_tokens": 16384,
        "max_model_len": MAX_MODEL_LEN,
        "max_running_requests": 64,
        "log_interval": 0.0,
        "seed": 0,
    }
    values.update(overrides)
    pool = values["kv_cache_tokens"]
    if "max_model_len" not in overrides and pool is not None:
        # a small pool's tests serve the context it holds (one set past it is refused)
        values["max_model_len"] = min(MAX_MODEL_LEN, pool)
    return EngineConfig(**values)


@dataclass(slots=True)
class RunningServer:
    engine: Any
    app: web.Application
    runner: web.AppRunner
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics(self) -> ServerMetrics:
        return self.app[STATE].metrics

    @property
    def model(self) -> str:
        return self.app[STATE].model_name

    async def stop(self, stop_engine: bool = True) -> None:
        await self.runner.cleanup()
        if stop_engine:
            await self.engine.stop()


async def start_server(
    config: EngineConfig, engine: Any | None = None, **app_kwargs: Any
) -> RunningServer:
    """A started engine (or the one given) behind a fresh app on 127.0.0.1:<ephemeral port>."""
    from asyncengine.api.engine import AsyncEngine

    if engine is None:
        engine = AsyncEngine(config)
        await engine.start()
    app = create_app(engine, **app_kwargs)
    runner, port = await start_http(app, "127.0.0.1", 0, shutdown_grace=2.0)
    return RunningServer(engine, app, runner, port)


async def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02
) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return predicate()


def engine_idle(engine: Any) -> bool:
    stats = engine.stats()
    idle = stats["running"] == stats["prefilling"] == stats["waiting"] == 0
    return idle and stats["pages_used"] == 0


def assert_no_leak(engine: Any) -> None:
    """Nothing runs or waits, no page is held outside the prefix cache (and its kept tails),
    and the invariant holds."""
    stats = engine.stats()
    assert stats["running"] == stats["prefilling"] == stats["waiting"] == 0, stats
    assert stats["pages_used"] == 0, stats
    cached = stats["pages_cached"] + stats["pages_tail"]
    assert stats["pages_free"] + cached == stats["pages_total"], stats
    engine.scheduler.kv.check_invariant()


def split_sse(raw: bytes) -> list[bytes]:
    """The payloads of a complete SSE body, checking that every event is one ``data: `` line
    ending with a blank line and that ``[DONE]`` comes last, once."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    payloads = []
    for event in events:
        assert event.startswith(b"data: "), event[:200]
        assert b"\n" not in event, event[:200]
        payloads.append(event[len(b"data: ") :])
    assert payloads[-1] == b"[DONE]", payloads[-3:]
    assert payloads.count(b"[DONE]") == 1
    return payloads


def sse_json(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(p) for p in split_sse(raw)[:-1]]


@dataclass(slots=True)
class ServerProcess:
    proc: asyncio.subprocess.Process
    port: int
    lines: list[str]  # stderr so far
    reader: asyncio.Task[None]  # collects stderr until the process closes it


@contextlib.asynccontextmanager
async def server_subprocess(
    *args: str, preexec_fn: Callable[[], object] | None = None
) -> AsyncIterator[ServerProcess]:
    """``python *args`` serving on loopback (it logs "serving ... on http://127.0.0.1:PORT");
    killed on the way out if it still runs. ``preexec_fn`` runs in the child before it starts
    (resource limits to start it under)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        preexec_fn=preexec_fn,
    )  # fmt: skip
    lines: list[str] = []
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    assert proc.stderr is not None
    reader = asyncio.create_task(_read_server_stderr(proc.stderr, lines, port))
    try:
        yield ServerProcess(proc, await asyncio.wait_for(port, 120), lines, reader)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()


async def _read_server_stderr(
    stream: asyncio.StreamReader, lines: list[str], port: asyncio.Future[int]
) -> None:
    """Collect a server subprocess's stderr lines; resolve ``port`` from its "serving" line."""
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        lines.append(text)
        if match := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", text):
            if not port.done():
                port.set_result(int(match.group(1)))
