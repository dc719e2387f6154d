#!/usr/bin/env python
"""Batch-1 decode speed: asyncengine and vLLM side by side, against the memory-bandwidth bound.

One request at a time: a ``--prompt-len`` (16) token prompt of random ids (numpy
``default_rng(seed)``, the same prompt peers/vllm/runner.py draws) and ``--output-len`` (256) tokens,
greedy, EOS ignored. Each of ``--repeats`` rounds times the prompt with one output token (the
prefill and first token) and with all of them; decode tok/s = (output_len - 1) / (median full -
median first), as ``scripts/peers/vllm/runner.py --single-stream`` measures vLLM (run in the same
invocation, from its own virtualenv: ``scripts/setup_vllm_cpu.sh``).

The bound: at batch 1 every decode step reads all the weights once, so decode cannot beat
memory bandwidth / weight bytes tokens/s. The bandwidth is this machine's copy bandwidth: the
median over ``--bandwidth-repeats`` torch copies of a ``--bandwidth-mib`` tensor, counting the
bytes read plus the bytes written (STREAM's convention for Copy). The weight bytes are every
parameter of the checkpoint in the run's dtype, the embedding table counted once when the LM
head is tied to it (it is read once per step, as the LM head; the input embedding reads one
row). KV reads (a few hundred tokens) and activations are left out: the bound is optimistic.

Both systems report start-up seconds, peak RSS (asyncengine: this process's ``ru_maxrss``; vLLM:
its process tree's summed RSS; llama.cpp: the server's VmHWM), idle RSS (VmRSS once the engine
or llama-server can serve, before any request: asyncengine's peak is larger after a prompt of 32+
tokens, which builds the dense copy of the quantized projections) and the share of the CPUs
other processes used while timed.

    python scripts/bench_single_stream.py --dtype bfloat16 --out bench_results/single_bf16.json
    python scripts/bench_single_stream.py --systems asyncengine --repeats 1 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/peers, systems.py

from peers.llamacpp import launcher as peer_llamacpp
from peers.vllm import launcher as peer_vllm
from systems import (
    AsyncEngineSystem,
    LlamaCppSystem,
    VllmSystem,
    build_cpu_kernels,
    cell,
    finish,
    model_dir_for,
    require_peers,
    resolve_dtype,
)

from asyncengine.common.config import EngineConfig, key_value
from asyncengine.script_main import run_main

SYSTEMS = ("asyncengine", "vllm", "llamacpp")


# -- the bound -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Memory bandwidth: bytes moved per second (a copy: read + written; a read: read), the
    median over repeats."""

    bytes_per_second: float
    tensor_bytes: int
    seconds: list[float]

    @property
    def gb_per_second(self) -> float:
        return self.bytes_per_second / 1e9


def copy_bandwidth(tensor_bytes: int, seconds: Sequence[float]) -> Bandwidth:
    """Each copy reads ``tensor_bytes`` and writes as many: 2 x bytes / the median time."""
    if not seconds or min(seconds) <= 0:
        raise ValueError(f"need positive copy times, got {list(seconds)}")
    return Bandwidth(2 * tensor_bytes / statistics.median(seconds), tensor_bytes, list(seconds))


def measure_copy_bandwidth(mib: int, repeats: int) -> Bandwidth:
    import torch

    n = mib << 20
    src = torch.ones(n, dtype=torch.uint8)  # touched: no page faults in the timed copies
    dst = torch.zeros(n, dtype=torch.uint8)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return copy_bandwidth(n, times)


def measure_read_bandwidth(mib: int, repeats: int) -> Bandwidth:
    """A multi-threaded read of ``mib`` MiB (torch's float32 sum: one pass, nothing written, as
    a decode step reads its weights): bytes / the median time."""
    import torch

    data = torch.ones((mib << 20) // 4, dtype=torch.float32)
    float(data.sum())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        float(data.sum())
        times.append(time.perf_counter() - start)
    if min(times) <= 0:
        raise ValueError(f"need positive read times, got {times}")
    return Bandwidth(data.nbytes / statistics.median(times), data.nbytes, times)


READ_PROBE_MIB = 512  # above any L3: the probe reads from memory, as a decode step does


def read_rate(mib: int = READ_PROBE_MIB) -> float:
    """The machine's read bytes/s now (the bound of the run that follows: a VM's memory rate can
    change within seconds)."""
    return measure_read_bandwidth(mib, 3).bytes_per_second


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def safetensors_numels(model_dir: Path) -> dict[str, int]:
    """Element counts of every tensor in the directory's safetensors files (headers only)."""
    counts: dict[str, int] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                counts[name] = math.prod(info["shape"])
    return counts


def weight_bytes(model_dir: Path, dtype: str) -> dict[str, Any]:
    """Bytes one decode step reads: every parameter in ``dtype``, a tied LM head counted once
    (the embedding table is that head; a tied checkpoint that still stores lm_head.weight
    has it dropped)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    tied = bool(config.get("tie_word_embeddings", False))
    counts = safetensors_numels(model_dir)
    if tied:
        counts.pop("lm_head.weight", None)
    params = sum(counts.values())
    return {
        "parameters": params,
        "bytes": params * DTYPE_BYTES[dtype],
        "tied_embeddings_counted_once": tied,
    }


def gguf_weight_bytes(gguf_path: Path) -> dict[str, Any]:
    """Bytes one decode step reads when a GGUF's tensors are kept as stored (quantization "auto";
    llama.cpp reads the same): every tensor's stored bytes (a tied file has no output.weight)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    return {
        "parameters": sum(int(t.n_elements) for t in reader.tensors),
        "bytes": sum(int(t.n_bytes) for t in reader.tensors),
        "tied_embeddings_counted_once": "output.weight" not in {t.name for t in reader.tensors},
        "stored_as": f"GGUF as stored ({', '.join(types)})",
    }


def step_weight_bytes(model: str, model_dir: Path, dtype: str, quantization: str) -> dict[str, Any]:
    """The bytes behind the bound for the way asyncengine holds the weights in this run."""
    from asyncengine.executor.loader.default_model import gguf_file

    found = gguf_file(model) if quantization == "auto" else None
    if found is not None:
        return gguf_weight_bytes(found[0])
    dense = weight_bytes(model_dir, dtype)
    if quantization != "int8":
        return {**dense, "stored_as": dtype}
    # int8: the 2-D projection / embedding weights at one byte per value (+ a scale per row)
    counts = safetensors_numels(model_dir)
    int8_values = sum(
        n for name, n in counts.items() if name.endswith(("_proj.weight", "embed_tokens.weight"))
    )
    rest = dense["parameters"] - int8_values
    return {**dense, "bytes": int8_values + rest * DTYPE_BYTES[dtype], "stored_as": "int8"}


def bound_tokens_per_second(bandwidth_bytes_per_second: float, step_bytes: int) -> float:
    """Batch-1 decode ceiling: one full read of the weights per token."""
    if step_bytes <= 0:
        raise ValueError("a decode step reads a positive number of bytes")
    return bandwidth_bytes_per_second / step_bytes


def single_stream_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """The prompt peers/vllm/runner.py --single-stream draws (numpy default_rng(seed).integers)."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab_size, size=length)]


# -- the systems -----------------------------------------------------------------------------


# -- report ----------------------------------------------------------------------------------


def add_fractions(result: dict[str, Any]) -> None:
    """Each system's share of the bound, and asyncengine's speed over vLLM's."""
    bound = result["bound_tokens_per_second"]
    for row in result["runs"].values():
        row["fraction_of_bound"] = row["decode_tokens_per_second"] / bound
    for peer in ("vllm", "llamacpp"):
        if {"asyncengine", peer} <= set(result["runs"]):
            ours = result["runs"]["asyncengine"]["decode_tokens_per_second"]
            theirs = result["runs"][peer]["decode_tokens_per_second"]
            if ours > 0 and theirs > 0:  # nan: a first token slower than the whole request
                result[f"speedup_vs_{peer}"] = ours / theirs


def cpu_ms_per_token(row: dict[str, Any], result: dict[str, Any]) -> float | None:
    """The system's own CPU time per token generated in the timed repeats (each repeat: one
    1-token and one output_len-token request): with one thread (``--threads 1``) the cost of a
    token whatever else keeps the machine busy; with more it also counts threads waiting."""
    cpu = row.get("cpu_seconds")
    if cpu is None:
        return None
    return 1e3 * float(cpu) / (result["repeats"] * (result["output_len"] + 1))


def table(result: dict[str, Any]) -> str:
    lines = [
        "| system | decode tok/s | ms/token | first token ms | of the bound | start-up s "
        "| idle RSS GB | peak RSS GB | others' CPU | CPU ms/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in result["runs"].items():
        tps = row["decode_tokens_per_second"]
        rss = row.get("peak_rss_bytes")
        idle = row.get("idle_rss_bytes")
        cells = [
            name,
            cell(tps, "{:.1f}"),
            cell(1e3 / tps if tps and math.isfinite(tps) else None, "{:.2f}"),
            cell(statistics.median(row["first_token_seconds"]) * 1e3, "{:.1f}"),
            cell(row["fraction_of_bound"], "{:.1%}"),
            cell(row.get("startup_seconds"), "{:.1f}"),
            cell(None if idle is None else idle / 1e9, "{:.2f}"),
            cell(None if rss is None else rss / 1e9, "{:.2f}"),
            cell(row.get("foreign_cpu_fraction"), "{:.0%}"),
            cell(cpu_ms_per_token(row, result), "{:.2f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    w = result["weights"]
    lines += [
        "",
        f"bound: {result['bandwidth']['gb_per_second']:.1f} GB/s copy bandwidth (read + write, "
        f"median of {len(result['bandwidth']['seconds'])} copies of "
        f"{result['bandwidth']['tensor_bytes'] >> 20} MiB) / {w['bytes'] / 1e6:.1f} MB of "
        f"{w.get('stored_as', result['dtype'])} weights per step "
        f"({w['parameters'] / 1e6:.1f} M parameters"
        + (", tied embeddings counted once" if w["tied_embeddings_counted_once"] else "")
        + f") = {result['bound_tokens_per_second']:.1f} tok/s",
    ]
    for peer, name in (("vllm", "vLLM"), ("llamacpp", "llama.cpp")):
        if f"speedup_vs_{peer}" in result:
            ratio = result[f"speedup_vs_{peer}"]
            lines.append(
                f"asyncengine ahead of {name} by {ratio:.2f}x at batch 1"
                if ratio >= 1
                else f"asyncengine behind {name} at batch 1: {ratio:.2f}x its speed"
            )
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name, HF dir or .gguf")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        metavar="SYSTEM",
        help="asyncengine, vllm and/or llamacpp, space- or comma-separated (vllm needs "
        "scripts/setup_vllm_cpu.sh, llamacpp scripts/setup_llamacpp.sh)",
    )
    parser.add_argument(
        "--llamacpp-model",
        choices=LlamaCppSystem.model_kinds,
        default=None,
        help="llama.cpp's GGUF (default: q4_1 when asyncengine keeps the embedded file "
        "quantized, else the run's dtype)",
    )
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads of each system (asyncengine: torch's; llama.cpp: -t); 0: their defaults",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=None, help="TOML engine config for asyncengine")
    parser.add_argument(
        "--engine-arg",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="asyncengine config override (repeatable)",
    )
    parser.add_argument(
        "--vllm-peer-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra peers/vllm/runner.py argument (repeatable), e.g. --vllm-peer-arg=--quiet-wait=300",
    )
    parser.add_argument("--vllm-timeout", type=float, default=1800.0)
    parser.add_argument("--vllm-workdir", type=Path, default=None)
    parser.add_argument("--bandwidth-mib", type=int, default=512)
    parser.add_argument("--bandwidth-repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.output_len < 2 or args.repeats < 1 or args.prompt_len < 1:
        raise SystemExit("need --output-len >= 2, --repeats >= 1 and --prompt-len >= 1")
    systems = list(
        dict.fromkeys(n.strip() for v in args.systems for n in v.split(",") if n.strip())
    )
    if not systems or not set(systems) <= set(SYSTEMS):
        raise SystemExit(f"--systems: choose from {', '.join(SYSTEMS)}, got {args.systems}")
    require_peers(systems)
    build_cpu_kernels(systems)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # asyncengine runs in this process
    dtype = resolve_dtype(args.dtype, "cpu")
    started = time.time()
    model_dir = model_dir_for(args.model, dtype)
    config = EngineConfig.from_toml(
        args.config,
        **{"model": args.model, "dtype": dtype, "device": "cpu", "log_interval": 0.0},
        **dict(args.engine_arg),
    )
    vocab = int(json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    prompt = single_stream_prompt(vocab, args.prompt_len, args.seed)

    weights = step_weight_bytes(args.model, model_dir, dtype, config.quantization)
    result: dict[str, Any] = {
        "mode": "single_stream",
        "model": args.model,
        "model_dir": str(model_dir),
        "dtype": dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "weights": weights,
        "runs": {},
    }
    if "asyncengine" in systems:
        row = AsyncEngineSystem.run_stream(config, prompt, args.output_len, args.repeats)
        result["runs"]["asyncengine"] = row
        print(f"asyncengine: {row['decode_tokens_per_second']:.1f} decode tok/s", flush=True)
    if "vllm" in systems:
        vllm = VllmSystem(args.vllm_timeout, args.vllm_workdir)
        kv_bytes = vllm.kv_cache_bytes(config, model_dir, dtype)
        try:
            row = vllm.run_stream(
                model_dir, dtype, kv_bytes, args.prompt_len, args.output_len, args.repeats,
                args.seed, args.vllm_peer_arg,
            )  # fmt: skip
        except peer_vllm.VllmPeerError as exc:
            raise SystemExit(f"vllm: {exc}") from None
        result["runs"]["vllm"] = row
        print(f"vllm: {row['decode_tokens_per_second']:.1f} decode tok/s", flush=True)
    if "llamacpp" in systems:
        kind = LlamaCppSystem.model_kind(
            args.llamacpp_model, args.model, config.quantization, dtype
        )
        try:
            row = LlamaCppSystem.run_stream(
                kind, prompt, args.output_len, args.repeats, args.threads or None
            )
        except (peer_llamacpp.LlamaCppPeerError, peer_llamacpp.LlamaCppUnavailableError) as exc:
            raise SystemExit(f"llamacpp: {exc}") from None
        result["runs"]["llamacpp"] = row
        print(f"llamacpp ({kind}): {row['decode_tokens_per_second']:.1f} decode tok/s", flush=True)
    # after the systems: its 2 x 512 MiB would otherwise count in asyncengine's peak RSS
    bandwidth = measure_copy_bandwidth(args.bandwidth_mib, args.bandwidth_repeats)
    result["bandwidth"] = {**asdict(bandwidth), "gb_per_second": bandwidth.gb_per_second}
    result["bound_tokens_per_second"] = bound_tokens_per_second(
        bandwidth.bytes_per_second, weights["bytes"]
    )
    add_fractions(result)
    return finish(result, "scripts/bench_single_stream.py", argv, started, args.out, table)


if __name__ == "__main__":
    run_main(main)
