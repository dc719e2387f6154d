"""The systems the end-to-end benchmarks run, each in one place, and how they measure and report.

- ``AsyncEngineSystem``: ours, in this process (offline, one stream) or as ``asyncengine serve``.
- ``VllmSystem``: vLLM's CPU build in its own virtualenv (``scripts/peers/vllm/``): its runner
  in a bounded subprocess (offline, one stream) or ``vllm serve``.
- ``LlamaCppSystem``: llama.cpp's ``llama-server`` (``scripts/peers/llamacpp/``).

Hugging Face transformers runs only in bench_offline.py (padded and continuous batching).
Each system can ``run_offline`` (every request at once, timed from the first to the last),
``run_stream`` (batch 1: each repeat times one token, then all of them) and give a ``server``
(``start``/``stop``, 127.0.0.1 and a free port) for bench_serving.py. ``write_json`` and
``cell`` are the one JSON writer and table cell of the three benchmarks.

Used by scripts/bench_offline.py, scripts/bench_single_stream.py and scripts/bench_serving.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/peers beside this module

from peers.llamacpp import launcher as peer_llamacpp
from peers.vllm import launcher as peer_vllm

from asyncengine.common.config import EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.workloads.trace import WorkloadRequest

ROOT = Path(__file__).resolve().parents[1]
# Not a prefix of any generated prompt (random ids), so the warm-up never turns into cache hits.
WARMUP_PROMPT = list(range(3, 19))


# -- the machine -----------------------------------------------------------------------------


@dataclass(slots=True)
class Timing:
    """Wall and CPU time of a timed region, with the machine's 1-minute load around it (the
    2-core CI machines are shared: a busy neighbour slows every system, see docs/BENCHMARKS.md)."""

    seconds: float = math.nan
    cpu_seconds: float = math.nan  # this process's CPU time, all threads
    load_start: float = math.nan
    load_end: float = math.nan
    # the share of the machine's CPU (all cores) that other processes used meanwhile
    foreign_cpu_fraction: float = math.nan


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine (all CPUs) since boot, from /proc/stat (Linux;
    nan elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def foreign_fraction(busy: float, own_cpu: float, wall: float) -> float:
    """Of ``wall`` seconds x all CPUs, the share busy with work other than ``own_cpu`` (the
    clock-tick counts are coarse: a short region can read a little over 1, kept at 1)."""
    if not wall > 0 or math.isnan(busy):
        return math.nan
    return min(1.0, max(0.0, busy - own_cpu) / (wall * (os.cpu_count() or 1)))


@contextlib.contextmanager
def timed() -> Iterator[Timing]:
    timing = Timing(load_start=os.getloadavg()[0])
    busy_start = machine_busy_seconds()
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        yield timing
    finally:
        timing.seconds = time.perf_counter() - start
        timing.cpu_seconds = time.process_time() - cpu_start
        timing.load_end = os.getloadavg()[0]
        timing.foreign_cpu_fraction = foreign_fraction(
            machine_busy_seconds() - busy_start, timing.cpu_seconds, timing.seconds
        )


def maxrss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # OpenMP's default spin-waiting collapses under a busy neighbour (see docs/BENCHMARKS.md)
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype every system runs in: ``auto`` becomes the engine's own pick for the device."""
    if dtype != "auto":
        return dtype
    from asyncengine.executor.device import pick_device, pick_dtype

    return str(pick_dtype("auto", pick_device(device))).removeprefix("torch.")


def model_dir_for(model: str, dtype_name: str) -> Path:
    """The model directory asyncengine loads for ``dtype_name`` (vLLM gets the same files)."""
    import torch

    from asyncengine.executor.loader import resolve_model

    return Path(resolve_model(model, getattr(torch, dtype_name)))


def require_peers(systems: Iterable[str]) -> None:
    """Refuse, before any system runs, a peer that is not installed (the error names the fix)."""
    names = set(systems)
    if "llamacpp" in names:
        try:
            peer_llamacpp.server_binary()
        except peer_llamacpp.LlamaCppUnavailableError as exc:
            raise SystemExit(f"--systems llamacpp: {exc}") from None
    if "vllm" in names:
        try:
            peer_vllm.require_vllm_venv()
        except peer_vllm.VllmUnavailableError as exc:
            raise SystemExit(f"--systems vllm: {exc}") from None


# the native CPU kernels every pool's engine may load, built (where not cached) and loaded
BUILD_CPU_KERNELS = """
from asyncengine.kernels.cpu import cpu_native, decode_step_native
for kv_dtype in decode_step_native.KV_DTYPES:
    cpu_native.load_all(cpu_native.kv_flags(kv_dtype))
    decode_step_native.available(kv_dtype)
"""


def build_cpu_kernels(systems: Iterable[str], device: str = "cpu") -> None:
    """Compile our native CPU kernels before any timing, in a process of its own: a first run on
    a machine otherwise counts gcc's 20-40 s in our start-up (every later start loads them from
    the cache, and a start-up figure is such a start)."""
    if "asyncengine" in set(systems) and device == "cpu":
        subprocess.run([sys.executable, "-c", BUILD_CPU_KERNELS], check=True)


# -- results ---------------------------------------------------------------------------------


@dataclass(slots=True)
class SystemRun:
    """One system's offline pass over the workload. ``outputs`` follow the workload's order."""

    system: str
    timing: Timing
    output_tokens: int  # useful tokens: the sum of the requests' output_len
    generated_tokens: int  # tokens the system computed, padding waste included
    outputs: list[list[int]] = field(repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.timing.seconds

    @property
    def cpu_seconds(self) -> float:
        return self.timing.cpu_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "load_average_start_end": [self.timing.load_start, self.timing.load_end],
            "foreign_cpu_fraction": self.timing.foreign_cpu_fraction,
            "output_tokens": self.output_tokens,
            "generated_tokens": self.generated_tokens,
            "output_tokens_per_second": self.tokens_per_second,
            **self.extra,
        }


def cell(value: Any, fmt: str) -> str:
    """A table cell: ``fmt`` of the value, ``-`` for none, NaN or infinity."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def finite(value: Any) -> Any:
    """JSON-safe: NaN/inf become null, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(result), indent=2) + "\n", encoding="utf-8")


def finish(
    result: dict[str, Any],
    script: str,
    argv: Sequence[str] | None,
    started: float,
    out: Path | None,
    render: Callable[[dict[str, Any]], str],
) -> dict[str, Any]:
    """A benchmark's last steps: the machine, the command and the run time into ``result``,
    its table printed, its JSON written to ``out`` when given."""
    result["machine"] = machine()
    result["command"] = " ".join([script, *(argv if argv is not None else sys.argv[1:])])
    result["bench_seconds"] = time.time() - started
    print(render(result))
    if out is not None:
        write_json(out, result)
        print(f"wrote {out}")
    return result


def greedy(output_len: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)


def decode_tokens_per_second(
    output_len: int, first_seconds: Sequence[float], full_seconds: Sequence[float]
) -> float:
    """(output_len - 1) tokens in (median full - median first) seconds."""
    gap = statistics.median(full_seconds) - statistics.median(first_seconds)
    return (output_len - 1) / gap if gap > 0 else math.nan


async def stream_repeats(
    generate: Callable[[int], Awaitable[Any]],
    output_len: int,
    repeats: int,
    before_each: Callable[[], object] | None = None,
) -> tuple[list[float], list[float], list[Any]]:
    """Batch-1 timing: each repeat times one token (prefill and the first token), then all
    ``output_len``; the replies of the full requests come back too. ``before_each`` runs, untimed,
    before every repeat (e.g. a probe of the machine's read rate)."""
    firsts, fulls, replies = [], [], []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        await generate(1)
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        replies.append(await generate(output_len))
        fulls.append(time.perf_counter() - start)
    return firsts, fulls, replies


# -- servers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LaunchedServer:
    """``asyncengine serve`` in a child process on 127.0.0.1, in its own process group; stopped
    with SIGTERM, then whatever is left of the group with SIGKILL."""

    name = "asyncengine"

    def __init__(self, serve_args: Sequence[str], startup_timeout: float, log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = self.build_command(serve_args)
        self.startup_timeout = startup_timeout
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None  # start to a healthy /health

    def build_command(self, serve_args: Sequence[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "asyncengine.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--shutdown-grace",
            "5",
            *serve_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        started = time.perf_counter()
        self.process = subprocess.Popen(
            self.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            cwd=str(ROOT),
            start_new_session=True,  # its children (vLLM's engine processes) stop with it
        )
        log.close()
        try:
            asyncio.run(self._wait_healthy())
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - started

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise SystemExit(
                        f"the {self.name} server exited with code {self.process.returncode} "
                        f"while starting; log: {self.log_path}\n{self.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(
                        self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=2)
                    ) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.25)
        raise SystemExit(
            f"the {self.name} server was not healthy after {self.startup_timeout:.0f}s; "
            f"log: {self.log_path}\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        return peer_vllm.log_tail(self.log_path, lines)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        code = self.process.poll()
        if code is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                peer_vllm.stop_group(self.process, grace=0.0)
                code = self.process.wait(timeout=10)
        if peer_vllm.group_alive(self.process.pid):  # a child that outlived the server
            peer_vllm.stop_group(self.process, grace=10.0)
        return code


class VllmServer(LaunchedServer):
    """``vllm serve`` (scripts/peers/vllm/serve.sh, vLLM's own virtualenv) on 127.0.0.1."""

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        kv_cache_bytes: int,
        flags: Sequence[str],
        startup_timeout: float,
        log_path: Path,
    ) -> None:
        self.model_dir, self.dtype, self.kv_cache_bytes = model_dir, dtype, kv_cache_bytes
        super().__init__(flags, startup_timeout, log_path)

    def build_command(self, serve_args: Sequence[str]) -> list[str]:
        return [
            "bash",
            str(peer_vllm.PEER_DIR / "serve.sh"),
            str(self.model_dir),
            str(self.port),
            self.dtype,
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            *serve_args,
        ]

    def environment(self) -> dict[str, str]:
        return peer_vllm.peer_env()

    def stop(self, timeout: float = 60.0) -> int | None:  # its engine core shuts down too
        return super().stop(timeout)


class LlamaCppServer(LaunchedServer):
    """llama.cpp's ``llama-server`` (scripts/setup_llamacpp.sh, scripts/peers/llamacpp/launcher.py) on
    127.0.0.1: ``-np`` slots of 1536 tokens each, its OpenAI ``/v1/completions`` streamed."""

    name = "llamacpp"

    def __init__(self, gguf: Path, parallel: int, startup_timeout: float, log_path: Path) -> None:
        self.peer = peer_llamacpp.LlamaServer(gguf, parallel=parallel)
        super().__init__([], startup_timeout, log_path)

    def build_command(self, serve_args: Sequence[str]) -> list[str]:
        self.peer.port = self.port
        return self.peer.command

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> None:
        """As ``LaunchedServer.start``; a start with the weights repacked that dies of SIGILL
        goes again with them as stored (the launcher's ``as_stored_after``)."""
        try:
            super().start()
        except SystemExit:
            if self.process is None or not self.peer.as_stored_after(self.process.returncode):
                raise
            self.command = self.peer.command
            super().start()


# -- asyncengine -----------------------------------------------------------------------------

# the engine settings an offline result reports beside its figures
REPORTED_SETTINGS = (
    "policy",
    "page_size",
    "kv_cache_tokens",
    "max_running_requests",
    "max_prefill_tokens",
    "chunked_prefill_size",
    "enable_mixed_batch",
    "enable_prefix_cache",
    "kv_cache_dtype",
)


class AsyncEngineSystem:
    """Ours: an ``AsyncEngine`` in this process, or ``asyncengine serve`` as a server."""

    name = "asyncengine"

    @staticmethod
    def run_offline(
        config: EngineConfig,
        workload: Sequence[WorkloadRequest],
        label: str = "asyncengine",
        progress: bool = True,
    ) -> SystemRun:
        """Every request submitted at once to one engine; wall time from the first submission
        to the last finish."""
        return asyncio.run(_engine_offline(config, workload, label, progress))

    @staticmethod
    def run_stream(
        config: EngineConfig, prompt: list[int], output_len: int, repeats: int
    ) -> dict[str, Any]:
        return asyncio.run(_engine_stream(config, prompt, output_len, repeats))

    @staticmethod
    def server(serve_args: Sequence[str], startup_timeout: float, log_path: Path) -> LaunchedServer:
        return LaunchedServer(serve_args, startup_timeout, log_path)


async def _engine_offline(
    config: EngineConfig, workload: Sequence[WorkloadRequest], label: str, progress: bool
) -> SystemRun:
    from asyncengine.api.engine import AsyncEngine

    started = time.perf_counter()
    async with AsyncEngine(config) as engine:
        startup = time.perf_counter() - started
        started = time.perf_counter()
        await engine.generate(WARMUP_PROMPT, greedy(4))
        warmup = time.perf_counter() - started
        before = engine.stats()
        bar = tqdm(total=len(workload), desc=label, unit="req", disable=not progress)

        async def one(item: WorkloadRequest) -> list[int]:
            out = await engine.generate(item.prompt_ids, greedy(item.output_len))
            bar.update(1)
            return out.token_ids

        with timed() as timing:
            outputs = await asyncio.gather(*(one(item) for item in workload))
        bar.close()
        after = engine.stats()
        runner = getattr(getattr(engine.core, "executor", None), "runner", None)
        pool = getattr(runner, "kv_pool", None)
        kv_pool_dtype = str(pool.dtype).removeprefix("torch.") if pool is not None else None

    def delta(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    hit, miss = delta("hit_tokens"), delta("miss_tokens")
    useful = sum(item.output_len for item in workload)
    settings = config.to_dict()
    extra = {
        "startup_seconds": startup,  # AsyncEngine.start: model load, KV pool, kernels
        "warmup_seconds": warmup,
        # this process's peak so far: asyncengine runs first, before any HF model is loaded
        "peak_rss_bytes": maxrss_bytes(),
        "hit_tokens": hit,
        "miss_tokens": miss,
        "cache_hit_rate": hit / (hit + miss) if hit + miss else 0.0,
        "retractions": delta("retractions"),
        "kv_pool_dtype": kv_pool_dtype,  # kv_cache_dtype as resolved (auto: float16 or not)
        "engine_config": {k: v for k, v in settings.items() if k in REPORTED_SETTINGS},
    }
    generated = sum(len(o) for o in outputs)
    return SystemRun(label, timing, useful, generated, list(outputs), extra)


async def _engine_stream(
    config: EngineConfig, prompt: list[int], output_len: int, repeats: int
) -> dict[str, Any]:
    from asyncengine.api.engine import AsyncEngine

    started = time.perf_counter()
    async with AsyncEngine(config) as engine:
        startup = time.perf_counter() - started
        # resident once it can serve, before any request (as llama-server's after /health): the
        # peak below also holds what serving the prompt built (a quantized model's dense copies
        # once a call has DENSE_FROM_ROWS rows or more, the KV pages it touched)
        idle_rss = peer_llamacpp.status_bytes(os.getpid(), "VmRSS")
        await engine.generate(prompt, greedy(8))  # warm-up
        load_start = os.getloadavg()[0]
        busy_start, cpu_start, wall_start = (
            machine_busy_seconds(),
            time.process_time(),
            time.perf_counter(),
        )

        async def generate(n: int) -> Any:
            out = await engine.generate(prompt, greedy(n))
            if len(out.token_ids) != n:
                raise RuntimeError(f"asyncengine gave {len(out.token_ids)} of {n} tokens")
            return out

        firsts, fulls, _ = await stream_repeats(generate, output_len, repeats)
        cpu = time.process_time() - cpu_start
        foreign = foreign_fraction(
            machine_busy_seconds() - busy_start, cpu, time.perf_counter() - wall_start
        )
    return {
        "first_token_seconds": firsts,
        "full_seconds": fulls,
        "decode_tokens_per_second": decode_tokens_per_second(output_len, firsts, fulls),
        "end_to_end_tokens_per_second": output_len / statistics.median(fulls),
        "startup_seconds": startup,
        "cpu_seconds": cpu,
        "peak_rss_bytes": maxrss_bytes(),
        "idle_rss_bytes": idle_rss,
        "foreign_cpu_fraction": foreign,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
    }


# -- vLLM (its CPU build, in its own virtualenv) ----------------------------------------------


@dataclass(slots=True)
class VllmSystem:
    """vLLM's runner (scripts/peers/vllm/run.sh) as a bounded subprocess, or ``vllm serve``.
    Its spec, result and log go to ``workdir`` (default: a new temporary folder)."""

    timeout: float = 7200.0
    workdir: Path | None = None
    name = "vllm"

    def folder(self, prefix: str) -> Path:
        folder = self.workdir or Path(tempfile.mkdtemp(prefix=prefix))
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    @staticmethod
    def kv_cache_bytes(config: EngineConfig, model_dir: Path, dtype: str) -> int:
        """A KV cache of as many tokens as asyncengine's pool holds for ``config``."""
        per_token = peer_vllm.kv_bytes_per_token(model_dir, dtype)
        return peer_vllm.engine_kv_tokens(config, per_token) * per_token

    @staticmethod
    def spec(
        config: EngineConfig,
        workload: Sequence[WorkloadRequest],
        model_dir: Path,
        dtype: str,
        vllm_args: Sequence[tuple[str, Any]] = (),
    ) -> dict[str, Any]:
        """peers/vllm/runner.py's spec: the workload's prompts and output lengths, and a KV cache
        of as many tokens as asyncengine's pool holds for ``config`` (bytes from the model's
        config)."""
        return peer_vllm.offline_spec(
            [(item.prompt_ids, item.output_len) for item in workload],
            model_dir,
            dtype,
            VllmSystem.kv_cache_bytes(config, model_dir, dtype),
            vllm_args,
        )

    @staticmethod
    def offline_run(result: dict[str, Any], workload: Sequence[WorkloadRequest]) -> SystemRun:
        """A SystemRun from peers/vllm/runner.py's offline result; its outputs must match the
        workload."""
        token_ids = result.get("token_ids")
        if token_ids is None:
            raise peer_vllm.VllmPeerError("the vLLM result holds no token_ids")
        peer_vllm.check_outputs(token_ids, [item.output_len for item in workload])
        timing = Timing(
            seconds=float(result["seconds"]),
            cpu_seconds=float(result["cpu_seconds"]),  # the whole process tree
            load_start=float(result.get("load_start", math.nan)),
            load_end=float(result.get("load_end", math.nan)),
            foreign_cpu_fraction=float(result.get("foreign_cpu_fraction", math.nan)),
        )
        extra = {
            "startup_seconds": result.get("startup_seconds"),  # vllm.LLM(...): compile included
            "warmup_seconds": result.get("warmup_seconds"),
            "peak_rss_bytes": result.get("peak_tree_rss_bytes"),  # summed over the tree
            "peak_pss_bytes": result.get("peak_tree_pss_bytes"),
            "main_process_cpu_seconds": result.get("main_process_cpu_seconds"),
            "vllm_version": result.get("vllm_version"),
            "engine_config": result.get("engine", {}),
            "env": result.get("env", {}),
        }
        outputs = [[int(t) for t in ids] for ids in token_ids]
        useful = sum(item.output_len for item in workload)
        return SystemRun("vllm", timing, useful, sum(len(o) for o in outputs), outputs, extra)

    def run_offline(
        self,
        config: EngineConfig,
        workload: Sequence[WorkloadRequest],
        dtype: str,
        vllm_args: Sequence[tuple[str, Any]],
    ) -> SystemRun:
        """The same requests as token ids, each with ``min_tokens = max_tokens = output_len``
        and ``ignore_eos``, greedy, one ``llm.generate`` timed."""
        peer_vllm.require_vllm_venv()  # before anything else: the error names the fix
        model_dir = model_dir_for(config.model, dtype)
        spec = self.spec(config, workload, model_dir, dtype, vllm_args)
        folder = self.folder("bench_offline_vllm_")
        spec_path, result_path, log_path = (
            folder / "vllm_spec.json",
            folder / "vllm_result.json",
            folder / "vllm.log",
        )
        spec_path.write_text(json.dumps(spec) + "\n", encoding="utf-8")
        result_path.unlink(missing_ok=True)
        print(f"vllm: scripts/peers/vllm/run.sh {spec_path} (log: {log_path})", flush=True)
        peer_vllm.run_peer([str(spec_path), "--out", str(result_path)], self.timeout, log_path)
        run = self.offline_run(peer_vllm.read_result(result_path, log_path), workload)
        per_token = peer_vllm.kv_bytes_per_token(model_dir, dtype)
        run.extra["kv_cache"] = {
            "asyncengine_pool_tokens": peer_vllm.engine_kv_tokens(config, per_token),
            "bytes_per_token": per_token,
            "requested_bytes": spec.get("kv_cache_bytes"),
        }
        run.extra["model_dir"] = str(model_dir)
        run.extra["spec_settings"] = {k: v for k, v in spec.items() if k != "requests"}
        run.extra["files"] = {
            "spec": str(spec_path),
            "result": str(result_path),
            "log": str(log_path),
        }
        return run

    def run_stream(
        self,
        model_dir: Path,
        dtype: str,
        kv_bytes: int,
        prompt_len: int,
        output_len: int,
        repeats: int,
        seed: int,
        peer_args: Sequence[str] = (),
    ) -> dict[str, Any]:
        """``runner.py --single-stream``: the same prompt (drawn from ``seed``) and timing."""
        folder = self.folder("bench_single_stream_vllm_")
        result_path, log_path = (
            folder / f"vllm_single_{dtype}.json",
            folder / f"vllm_single_{dtype}.log",
        )
        result_path.unlink(missing_ok=True)
        args = [
            "--single-stream", "--model", str(model_dir), "--dtype", dtype,
            "--prompt-len", str(prompt_len), "--output-len", str(output_len),
            "--repeats", str(repeats), "--seed", str(seed), "--kv-bytes", str(kv_bytes),
            "--out", str(result_path), *peer_args,
        ]  # fmt: skip
        print(f"vllm: scripts/peers/vllm/run.sh {' '.join(args)} (log: {log_path})", flush=True)
        peer_vllm.run_peer(args, self.timeout, log_path)
        return self.stream_row(peer_vllm.read_result(result_path, log_path), log_path)

    @staticmethod
    def stream_row(result: dict[str, Any], log_path: Path | None = None) -> dict[str, Any]:
        """The row of peers/vllm/runner.py's single-stream result, in asyncengine's row's terms."""
        return {
            "first_token_seconds": result["first_token_seconds"],
            "full_seconds": result["full_seconds"],
            "decode_tokens_per_second": float(result["decode_tokens_per_second"]),
            "end_to_end_tokens_per_second": result.get("end_to_end_tokens_per_second"),
            "startup_seconds": result.get("startup_seconds"),
            "cpu_seconds": result.get("cpu_seconds"),  # the whole process tree
            "peak_rss_bytes": result.get("peak_tree_rss_bytes"),
            "peak_pss_bytes": result.get("peak_tree_pss_bytes"),
            "foreign_cpu_fraction": result.get("foreign_cpu_fraction"),
            "load_start": result.get("load_start"),
            "load_end": result.get("load_end"),
            "vllm_version": result.get("vllm_version"),
            "engine_config": result.get("engine", {}),
            "log": None if log_path is None else str(log_path),
        }

    @staticmethod
    def server(
        model_dir: Path,
        dtype: str,
        kv_cache_bytes: int,
        settings: Sequence[tuple[str, Any]],
        startup_timeout: float,
        log_path: Path,
    ) -> VllmServer:
        return VllmServer(
            model_dir, dtype, kv_cache_bytes, vllm_flags(settings), startup_timeout, log_path
        )


def vllm_flags(settings: Sequence[tuple[str, Any]]) -> list[str]:
    """``--vllm-arg KEY=VALUE`` pairs as ``vllm serve`` flags: ``max_num_seqs=128`` ->
    ``--max-num-seqs 128``; true -> ``--key``; false -> ``--no-key``."""
    flags: list[str] = []
    for key, value in settings:
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        else:
            flags += [flag, value if isinstance(value, str) else json.dumps(value)]
    return flags


# -- llama.cpp (llama-server) ----------------------------------------------------------------


class LlamaCppSystem:
    """llama.cpp's ``llama-server`` on a GGUF (scripts/peers/llamacpp/launcher.py): prompts as
    token ids to ``/completion``, greedy, EOS ignored; peak RSS is the server's VmHWM."""

    name = "llamacpp"
    model_kinds = tuple(peer_llamacpp.MODEL_FILES)  # the GGUFs --llamacpp-model chooses from

    @staticmethod
    def model_kind(chosen: str | None, model: str, quantization: str, dtype: str) -> str:
        """The GGUF: ``chosen`` (``--llamacpp-model``), else the weights asyncengine runs."""
        return chosen or peer_llamacpp.model_kind_for(model, quantization, dtype)

    @staticmethod
    def run_offline(
        workload: Sequence[WorkloadRequest], model_kind: str, parallel: int
    ) -> SystemRun:
        """llama-server -np ``parallel`` on the GGUF of ``model_kind``, every request sent at
        once; timed from the first send to the last reply."""
        folder = Path(tempfile.mkdtemp(prefix="bench_offline_llamacpp_"))
        log_path = folder / "llama-server.log"
        # each slot holds its request's whole sequence (llama-server cuts a longer one short)
        longest = max(len(item.prompt_ids) + item.output_len for item in workload)
        server = peer_llamacpp.LlamaServer(
            peer_llamacpp.model_file(model_kind),
            parallel=parallel,
            context_per_slot=max(peer_llamacpp.CONTEXT_PER_SLOT, longest),
            log_path=log_path,
        )
        print(f"llamacpp: {' '.join(server.command)} (log: {log_path})", flush=True)
        requests = [(item.prompt_ids, item.output_len) for item in workload]
        with server:
            load_start = os.getloadavg()[0]
            busy_start = machine_busy_seconds()
            replies, seconds = asyncio.run(peer_llamacpp.run_requests(server, requests))
            busy = machine_busy_seconds() - busy_start
        timing = Timing(
            seconds=seconds,
            load_start=load_start,
            load_end=os.getloadavg()[0],
            # the server's own CPU counts as busy here: this is the machine's busy share
            foreign_cpu_fraction=foreign_fraction(busy, 0.0, seconds),
        )
        outputs = [[int(t) for t in reply["tokens"]] for reply in replies]
        extra = {
            "startup_seconds": server.startup_seconds,
            "peak_rss_bytes": server.peak_rss_bytes,
            "idle_rss_bytes": server.idle_rss_bytes,
            "model_file": model_kind,
            "command": " ".join(server.command),
            "log": str(log_path),
        }
        useful = sum(item.output_len for item in workload)
        return SystemRun("llamacpp", timing, useful, sum(len(o) for o in outputs), outputs, extra)

    @staticmethod
    def run_stream(
        model_kind: str, prompt: list[int], output_len: int, repeats: int, threads: int | None
    ) -> dict[str, Any]:
        """llama-server -np 1 (its best single-user setting) on the GGUF of ``model_kind``."""
        folder = Path(tempfile.mkdtemp(prefix="bench_single_stream_llamacpp_"))
        log_path = folder / "llama-server.log"
        server = peer_llamacpp.LlamaServer(
            peer_llamacpp.model_file(model_kind), parallel=1, threads=threads, log_path=log_path
        )
        print(f"llamacpp: {' '.join(server.command)} (log: {log_path})", flush=True)
        with server:
            row = asyncio.run(_llamacpp_stream(server, prompt, output_len, repeats))
        return {
            **row,
            "model_file": model_kind,
            "startup_seconds": server.startup_seconds,
            "peak_rss_bytes": server.peak_rss_bytes,
            "idle_rss_bytes": server.idle_rss_bytes,
            "command": " ".join(server.command),
            "log": str(log_path),
        }

    @staticmethod
    def server(
        model_kind: str, parallel: int, startup_timeout: float, log_path: Path
    ) -> LlamaCppServer:
        return LlamaCppServer(
            peer_llamacpp.model_file(model_kind), parallel, startup_timeout, log_path
        )


async def _llamacpp_stream(
    server: peer_llamacpp.LlamaServer, prompt: list[int], output_len: int, repeats: int
) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await server.complete(session, prompt, 8)  # warm-up
        load_start = os.getloadavg()[0]
        busy_start, wall_start = machine_busy_seconds(), time.perf_counter()
        cpu_start = server.cpu_seconds()

        async def generate(n: int) -> Any:
            return await server.complete(session, prompt, n)

        firsts, fulls, replies = await stream_repeats(generate, output_len, repeats)
        wall = time.perf_counter() - wall_start
        cpu = server.cpu_seconds() - cpu_start
    reported = [
        float(reply.get("timings", {}).get("predicted_per_second", math.nan)) for reply in replies
    ]
    return {
        "cpu_seconds": cpu,
        "first_token_seconds": firsts,
        "full_seconds": fulls,
        "decode_tokens_per_second": decode_tokens_per_second(output_len, firsts, fulls),
        "end_to_end_tokens_per_second": output_len / statistics.median(fulls),
        "server_reported_tokens_per_second": statistics.median(reported),
        # its own CPU time is not ours to count: the share of the machine busy meanwhile
        "machine_busy_fraction": foreign_fraction(machine_busy_seconds() - busy_start, 0.0, wall),
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
    }
