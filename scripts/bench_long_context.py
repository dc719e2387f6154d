#!/usr/bin/env python
"""Long contexts on the CPU: prefill and decode speed by K/V pool, ours side by side with
llama.cpp's ``llama-bench`` (f16 and q8_0 K/V).

Ours runs the model's ``ModelRunner`` directly (the engine's forward: the native extend kernel
for prefills in ``--chunk``-token chunks as the engine chunks them, the fused decode step for
decodes), one runner per ``--kv`` entry, all loaded at once and timed in turn, repeat by repeat
(the order rotated each round), so that a host's drift lands on every pool alike:

- ``bfloat16``: the model in bfloat16, its pool bfloat16 (what a bfloat16 model keeps);
- ``float32`` / ``float16`` / ``int8``: the model in float32 with that pool (int8:
  ``kv_cache_dtype = "int8"``, a scale per token and head);
- ``bfloat16-int8``: the model in bfloat16 over an int8 pool (a bfloat16 model's
  ``kv_cache_dtype = "int8"``).

One stream, for each ``--contexts`` N: prefill tok/s of an N-token prompt into an empty pool
and, where 2N fits the model's positions, of N more tokens after N already cached (llama-bench's
pp N at depth N); decode tok/s of ``--decode`` (64) tokens after N (tg at depth N), and its
fraction of the bandwidth bound: the bytes a decoded token reads (every weight of the GGUF once,
the K/V of its context once: the pool's bytes per token) at ``--bandwidth`` GB/s (default: this
machine's read speed, measured: torch's sum over 1 GiB, above any L3). Then ``--batch`` (16)
requests of ``--batch-context`` (4096) tokens each decoding ``--batch-decode`` steps together:
decode tok/s summed over the batch. Decodes are medians of ``--repeats`` (3) runs, prefills of
``--prefill-repeats`` (1); prompts are random token ids (the same every run). Each test's
speed by pool is also given over the first ``--kv`` entry's (``ratios``: same run, interleaved).

llama.cpp: ``llama-bench -m GGUF -p N -n DECODE -d N -ctk T -ctv T -fa 1 -t THREADS -r R -o
json`` per context (``--llamacpp-repeats`` R, 1), for T in ``--llamacpp-kv`` (f16, q8_0;
quantized V needs flash attention), when its build is found (scripts/setup_llamacpp.sh;
``LLAMACPP_VENV``); rerun with ``--repack 0`` where its repacked weights crash its prompt
processing. Its GGUF is the one ours runs: ``--model``, a .gguf file or a known model name
(default the embedded Q4_1 file; a real shape from scripts/make_real_models.py). A context that
does not fit the model's with its decode is refused before anything loads. With
``--llamacpp-batch`` also ``llama-batched-bench -npp 4096 -ntg N -npl 16`` (off by default: its
65k prompt tokens take ~7 minutes a K/V type on 2 cores).

The defaults take ~15 minutes on a quiet 2-core AVX-512 machine:

    python scripts/bench_long_context.py --json bench_results/long_context.json
    python scripts/bench_long_context.py --contexts 1024 --decode 16 --batch 0 --kv float32,int8
    python scripts/bench_long_context.py --model ~/.cache/asyncengine/models/llama-3.2-1b/\
llama-3.2-1b-Q4_K_M.gguf --contexts 16384 --batch 0 --kv bfloat16-int8 --llamacpp-kv ''
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_single_stream import measure_read_bandwidth  # noqa: E402
from peers.llamacpp import launcher as peer_llamacpp  # noqa: E402
from systems import finish  # noqa: E402

from asyncengine.cache.page_table import PageTable  # noqa: E402
from asyncengine.common.config import EngineConfig  # noqa: E402
from asyncengine.common.plan import BatchPlan, Segment  # noqa: E402
from asyncengine.executor.kv_pool import KVPool  # noqa: E402
from asyncengine.executor.layers.model_config import ModelConfig  # noqa: E402
from asyncengine.executor.loader import read_gguf  # noqa: E402
from asyncengine.executor.loader.default_model import DEFAULT_MODEL, gguf_file, metadata_dir  # noqa: E402
from asyncengine.executor.runner import ModelRunner  # noqa: E402
from asyncengine.kernels.quant_formats import GGUF_FORMATS  # noqa: E402
from asyncengine.script_main import run_main  # noqa: E402

PAGE_SIZE = 16
WARM_UP_TOKENS = 64  # prefilled, then 2 decoded, before any timing
# --kv entry -> (the model's dtype, the pool's)
KV_RUNS = {
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float32, torch.float16),
    "int8": (torch.float32, torch.int8),
    "bfloat16-int8": (torch.bfloat16, torch.int8),
}


@dataclass(slots=True)
class Row:
    system: str  # "asyncengine" or "llama.cpp"
    kv: str
    test: str  # "prefill", "decode" or "batch decode"
    context: int  # tokens already in the pool before the timed tokens (depth)
    tokens: int  # timed tokens (a prefill's prompt, a decode's steps, x batch for a batch)
    batch: int
    tok_per_s: float
    bound_fraction: float | None = None  # decodes: tok/s over the bandwidth bound's


@dataclass(frozen=True, slots=True)
class Model:
    """The GGUF timed (ours and llama.cpp alike) and its config."""

    gguf: Path
    config: ModelConfig


def load_model(name_or_path: str) -> Model | None:
    """``--model``: a .gguf file or a known model name; None for anything else."""
    found = gguf_file(name_or_path)
    if found is None:
        return None
    gguf, cache_name = found
    meta = metadata_dir(gguf, cache_name)
    return Model(gguf, ModelConfig.from_hf_dict(json.loads((meta / "config.json").read_text())))


def context_errors(args: argparse.Namespace, limit: int) -> list[str]:
    """What in ``args`` asks for more positions than the model's context ``limit`` has."""
    errors = [
        f"--contexts {n} with --decode {args.decode} reaches {n + args.decode + 1} tokens"
        for n in args.contexts
        if n + args.decode + 1 > limit
    ]
    if args.batch and args.batch_context + args.batch_decode + 1 > limit:
        errors.append(
            f"--batch-context {args.batch_context} with --batch-decode {args.batch_decode} "
            f"reaches {args.batch_context + args.batch_decode + 1} tokens"
        )
    return [f"{e}, past the model's context of {limit}" for e in errors]


class Ours:
    """The model over a pool of ``rows`` rows of ``row_tokens`` slots each."""

    def __init__(self, model: Model, kv: str, rows: int, row_tokens: int) -> None:
        gguf = model.gguf
        self.config = model.config
        dtype, kv_dtype = KV_RUNS[kv]
        weights = read_gguf(gguf, dtype, frozenset(GGUF_FORMATS)).weights
        pages = -(-max(row_tokens, WARM_UP_TOKENS + 2) // PAGE_SIZE)  # the warm-up's too
        pool = KVPool.for_model(self.config, rows * pages, PAGE_SIZE, kv_dtype)
        table = PageTable.contiguous(rows, pages)
        self.runner = ModelRunner(self.config, weights, pool, table, dtype)
        # a decoded token reads every weight once and its context's K/V once
        self.weight_bytes = gguf.stat().st_size
        self.kv_bytes_per_token = pool.bytes_per_token
        self.step = 0
        # untimed: the kernels' first calls (a build compiled on first use, pages touched)
        warm_up = prompt(WARM_UP_TOKENS, 0, self.config.vocab_size)
        self.decode([0], [self.prefill(0, warm_up, 0, WARM_UP_TOKENS)], [WARM_UP_TOKENS], 2)

    def _run(self, plan_segments: dict[str, list[Segment]]) -> torch.Tensor:
        self.step += 1
        with torch.inference_mode():
            return self.runner.forward_logits(BatchPlan(step=self.step, **plan_segments))

    def prefill(self, row: int, tokens: list[int], start: int, chunk: int) -> int:
        """tokens at positions start.. in chunks; the greedy next token."""
        logits = None
        for first in range(0, len(tokens), chunk):
            part = tokens[first : first + chunk]
            logits = self._run({"extends": [Segment(f"r{row}", row, part, start + first, True)]})
        assert logits is not None
        return int(logits[-1].argmax())

    def decode(self, rows: list[int], tokens: list[int], starts: list[int], steps: int) -> None:
        positions = list(starts)
        for _ in range(steps):
            segments = [
                Segment(f"r{r}", r, [t], p, True)
                for r, t, p in zip(rows, tokens, positions, strict=True)
            ]
            logits = self._run({"decodes": segments})
            tokens = logits.argmax(-1).tolist()
            positions = [p + 1 for p in positions]


def interleaved_seconds(repeats: int, runs: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """The median wall time of each of ``runs`` over ``repeats`` rounds, each round one call of
    every run in turn, the order rotated by one each round."""
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def prompt(n: int, seed: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(min(100, vocab_size // 2), min(49000, vocab_size)) for _ in range(n)]


def bench_ours(args: argparse.Namespace, model: Model, kvs: list[str]) -> list[Row]:
    rows: list[Row] = []
    limit, vocab = model.config.max_model_len, model.config.vocab_size
    # N more after N only where 2N fits: the pool holds no more than the longest test reaches
    depth = max(2 * n if 2 * n <= limit else n for n in args.contexts)
    pools = {kv: Ours(model, kv, 1, depth + args.decode + 1) for kv in kvs}
    for n in args.contexts:
        tokens, more = prompt(n, n, vocab), prompt(n, n + 1, vocab)
        prefills = {kv: partial(o.prefill, 0, tokens, 0, args.chunk) for kv, o in pools.items()}
        for kv, seconds in interleaved_seconds(args.prefill_repeats, prefills).items():
            rows.append(Row("asyncengine", kv, "prefill", 0, n, 1, n / seconds))
        if 2 * n <= limit:  # N more after the N above, as llama-bench's -d N
            deeper = {kv: partial(o.prefill, 0, more, n, args.chunk) for kv, o in pools.items()}
            for kv, seconds in interleaved_seconds(args.prefill_repeats, deeper).items():
                rows.append(Row("asyncengine", kv, "prefill", n, n, 1, n / seconds))
        decodes = {
            kv: partial(o.decode, [0], [o.prefill(0, tokens, 0, args.chunk)], [n], args.decode)
            for kv, o in pools.items()
        }
        for kv, seconds in interleaved_seconds(args.repeats, decodes).items():
            ours = pools[kv]
            speed = args.decode / seconds
            token_bytes = ours.weight_bytes + ours.kv_bytes_per_token * (n + args.decode / 2)
            bound = args.bandwidth * 1e9 / token_bytes
            rows.append(Row("asyncengine", kv, "decode", n, args.decode, 1, speed, speed / bound))
        print(f"asyncengine context {n}: done", file=sys.stderr)
    del pools
    if args.batch:
        n, b = args.batch_context, args.batch
        pools = {kv: Ours(model, kv, b, n + args.batch_decode + 1) for kv in kvs}
        decodes = {}
        for kv, ours in pools.items():
            firsts = [ours.prefill(r, prompt(n, 1000 + r, vocab), 0, args.chunk) for r in range(b)]
            rows_of = list(range(b))
            decodes[kv] = partial(ours.decode, rows_of, firsts, [n] * b, args.batch_decode)
        total = b * args.batch_decode
        for kv, seconds in interleaved_seconds(args.repeats, decodes).items():
            rows.append(Row("asyncengine", kv, "batch decode", n, total, b, total / seconds))
    return rows


def ratios(rows: list[Row], kvs: list[str]) -> list[dict[str, Any]]:
    """Each of our tests' tok/s by pool over the first pool's (the same run, interleaved). A
    test is its kind, depth and timed tokens: every context's first prefill is at depth 0."""
    ours = [r for r in rows if r.system == "asyncengine"]
    base = {(r.test, r.context, r.tokens): r.tok_per_s for r in ours if r.kv == kvs[0]}
    return [
        {
            "kv": r.kv,
            "over": kvs[0],
            "test": r.test,
            "context": r.context,
            "tokens": r.tokens,
            "ratio": r.tok_per_s / base[(r.test, r.context, r.tokens)],
        }
        for r in ours
        if r.kv != kvs[0] and (r.test, r.context, r.tokens) in base
    ]


def llamacpp_tool(name: str) -> Path | None:
    try:
        server = peer_llamacpp.server_binary()
    except peer_llamacpp.LlamaCppUnavailableError:
        return None
    tool = server.with_name(name)
    return tool if tool.is_file() else None


def bench_llamacpp(args: argparse.Namespace, gguf: Path) -> list[Row]:
    bench = llamacpp_tool("llama-bench")
    if bench is None:
        print("llama.cpp: no llama-bench build found (scripts/setup_llamacpp.sh)", file=sys.stderr)
        return []
    rows: list[Row] = []
    threads = str(args.threads or torch.get_num_threads())
    for kv in args.llamacpp_kv:
        for n in args.contexts:
            command = [str(bench), "-m", str(gguf), "-p", str(n), "-n", str(args.decode)]
            command += ["-d", str(n), "-ctk", kv, "-ctv", kv, "-fa", "1", "-t", threads]
            command += ["-r", str(args.llamacpp_repeats), "-o", "json"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                # llama.cpp's repacked (AMX) weights crash its prompt processing on some CPUs:
                # the same run on the weights as stored, said so in the output
                print(
                    f"llama.cpp {kv} context {n}: failed ({done.returncode}); with --repack 0",
                    file=sys.stderr,
                )
                command += ["--repack", "0"]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
            for record in json.loads(done.stdout):
                depth, n_prompt, n_gen = record["n_depth"], record["n_prompt"], record["n_gen"]
                if n_prompt and depth == n:
                    rows.append(
                        Row("llama.cpp", kv, "prefill", depth, n_prompt, 1, record["avg_ts"])
                    )
                elif n_gen and depth == n:
                    rows.append(Row("llama.cpp", kv, "decode", depth, n_gen, 1, record["avg_ts"]))
            print(f"llama.cpp {kv} context {n}: done", file=sys.stderr)
        batched = llamacpp_tool("llama-batched-bench")
        if args.batch and args.llamacpp_batch and batched is not None:
            n, b = args.batch_context, args.batch
            command = [str(batched), "-m", str(gguf), "-c", str(b * (n + args.batch_decode + 1))]
            command += ["-npp", str(n), "-ntg", str(args.batch_decode), "-npl", str(b)]
            command += [
                "-ctk",
                kv,
                "-ctv",
                kv,
                "-fa",
                "1",
                "-t",
                threads,
                "--output-format",
                "jsonl",
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            for line in done.stdout.splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    total = b * args.batch_decode
                    rows.append(
                        Row("llama.cpp", kv, "batch decode", n, total, b, record["speed_tg"])
                    )
    return rows


def render(result: dict[str, Any]) -> str:
    lines = [
        f"bandwidth bound at {result['bandwidth_gbs']:.1f} GB/s",
        "| system | K/V | test | context | tokens | batch | tok/s | of the bound |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        share = f"{r['bound_fraction']:.0%}" if r["bound_fraction"] is not None else "-"
        lines.append(
            f"| {r['system']} | {r['kv']} | {r['test']} | {r['context']} | {r['tokens']} | "
            f"{r['batch']} | {r['tok_per_s']:.1f} | {share} |"
        )
    for r in result.get("ratios", []):
        lines.append(
            f"{r['kv']} over {r['over']}, {r['test']} of {r['tokens']} at {r['context']}: "
            f"{r['ratio']:.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="a .gguf file or a known model name (both systems)"
    )
    parser.add_argument("--contexts", default="1024,4096,7680", help="one-stream contexts")
    parser.add_argument("--decode", type=int, default=64, help="decode steps timed")
    parser.add_argument("--batch", type=int, default=16, help="requests decoding at once (0: off)")
    parser.add_argument("--batch-context", type=int, default=4096)
    parser.add_argument("--batch-decode", type=int, default=32)
    parser.add_argument("--kv", default="bfloat16,int8", help=f"of {', '.join(KV_RUNS)}")
    parser.add_argument("--llamacpp-kv", default="f16,q8_0", help="'' to skip llama.cpp")
    parser.add_argument("--chunk", type=int, default=EngineConfig().chunked_prefill_size)
    parser.add_argument("--repeats", type=int, default=3, help="of each decode")
    parser.add_argument("--prefill-repeats", type=int, default=1)
    parser.add_argument("--llamacpp-repeats", type=int, default=1)
    parser.add_argument("--llamacpp-batch", action="store_true", help="llama-batched-bench too")
    parser.add_argument("--bandwidth", type=float, default=0.0, help="GB/s (0: measure)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", type=Path, default=None)
    started = time.time()
    args = parser.parse_args()
    try:
        args.contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        raise ValueError(
            f"--contexts {args.contexts!r}: a comma-separated list of token counts"
        ) from None
    args.llamacpp_kv = [k for k in args.llamacpp_kv.split(",") if k]
    kvs = [kv for kv in args.kv.split(",") if kv]
    unknown = [kv for kv in kvs if kv not in KV_RUNS]
    if unknown:
        raise ValueError(f"--kv {','.join(unknown)}: each must be one of {', '.join(KV_RUNS)}")
    model = load_model(args.model)
    if model is None:
        raise ValueError(f"--model {args.model!r}: neither a .gguf file nor a known model name")
    errors = context_errors(args, model.config.max_model_len)
    if errors:
        raise ValueError("; ".join(errors))
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.bandwidth:
        args.bandwidth = measure_read_bandwidth(1024, 5).gb_per_second
    rows = bench_ours(args, model, kvs) if kvs else []
    if args.llamacpp_kv:
        rows += bench_llamacpp(args, model.gguf)
    setup = {
        "threads": torch.get_num_threads(),
        "model": str(model.gguf),
        "args": {**vars(args), "json": str(args.json)},
    }
    result = {
        "setup": setup,
        "bandwidth_gbs": args.bandwidth,
        "rows": [asdict(r) for r in rows],
        "ratios": ratios(rows, kvs) if kvs else [],
    }
    finish(result, "scripts/bench_long_context.py", None, started, args.json, render)


if __name__ == "__main__":
    run_main(main)
