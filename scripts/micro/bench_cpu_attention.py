#!/usr/bin/env python
"""The native CPU decode attention kernel over a pool far larger than the caches, as in a forward.

A decode step reads every running request's keys and values once per layer; inside a forward
the 30 layers' pools (hundreds of MB) never sit in the caches, so a benchmark that calls one
layer over and over measures the L3, not the step. This one gives each of ``--layers`` layers
its own pool (pages shuffled, as a long-running pool's are) and times a pass over all of them:
ms per layer, and GB/s of K/V read. Rows: each ``--shapes`` entry (batch x context) and dtype.

``--baseline-rev REV`` compiles ``kernels/cpu/cpu_decode_attention.c`` as it was at git revision
REV with the same flags and times it interleaved with today's (same pools, same queries,
alternating passes, medians): the ratio column is baseline / current. Outputs are compared
too (max abs difference). The torch reference path (``--torch``) can be timed as well.

    python scripts/micro/bench_cpu_attention.py --threads 2 --json bench_results/cpu_attention.json
    python scripts/micro/bench_cpu_attention.py --baseline-rev 8c81e39 --threads 1 --shapes 128x257
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncengine.kernels.cpu import cpu_native  # noqa: E402
from asyncengine.kernels.cpu.attention_native import (  # noqa: E402
    native_decode_attention,
    plan_native_decode,
)
from asyncengine.kernels.reference.attention_ref import decode_attention  # noqa: E402
from asyncengine.kernels.reference.kv_int8_ref import quantize_kv  # noqa: E402
from asyncengine.script_main import run_main  # noqa: E402

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# the decode kernel's C signature before and after window/softcap were added
_ARGS_PLAIN = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32]
_ARGS_PLAIN += [_PTR, _INT, _INT]
_ARGS_OPTIONS = [*_ARGS_PLAIN[:13], _I64, _F32, *_ARGS_PLAIN[13:]]


@dataclass(slots=True)
class Row:
    dtype: str
    batch: int
    context: int
    threads: int
    ms_per_layer: float
    gb_per_s: float
    baseline_ms_per_layer: float | None = None
    speedup_vs_baseline: float | None = None
    max_abs_diff_vs_baseline: float | None = None
    torch_ms_per_layer: float | None = None


class Pools:
    """``layers`` pools of one model's K/V heads, each holding ``batch`` requests of
    ``context`` tokens on shuffled pages."""

    def __init__(
        self,
        layers: int,
        batch: int,
        context: int,
        dtype: torch.dtype,
        args: argparse.Namespace,
        q_dtype: torch.dtype | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(0)
        page, heads, kv_heads, dim = args.page_size, args.heads, args.kv_heads, args.head_dim
        pages_each = -(-context // page)
        num_pages = batch * pages_each + 8
        order = torch.randperm(num_pages, generator=gen)
        self.block_table = order[: batch * pages_each].view(batch, pages_each).to(torch.int32)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32)
        shape = (num_pages * page, kv_heads, dim)

        def pool() -> torch.Tensor:
            values = torch.randn(shape, generator=gen)
            return quantize_kv(values) if dtype == torch.int8 else values.to(dtype)

        self.k = [pool() for _ in range(layers)]
        self.v = [pool() for _ in range(layers)]
        # a float16 or int8 pool is read beside float32 queries unless told (int8-bf16)
        if q_dtype is None:
            q_dtype = torch.float32 if dtype in (torch.float16, torch.int8) else dtype
        self.q = torch.randn(batch, heads, dim, generator=gen).to(q_dtype)
        self.page_size, self.scale, self.softcap = page, dim**-0.5, args.softcap
        row_bytes = self.k[0][0, 0].nbytes  # an int8 row's scale included
        self.bytes_per_layer = 2 * batch * context * kv_heads * row_bytes


def compile_baseline(rev: str, dtype: torch.dtype) -> Callable[..., int]:
    """The decode kernel of git revision ``rev``, compiled as cpu_native compiles today's for a
    pool of ``dtype`` (its -DKV_F16 / -DKV_I8 build for a float16 / int8 pool)."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:kernels/cpu/cpu_decode_attention.c"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    workdir = Path(tempfile.mkdtemp(prefix="bench_cpu_attention_"))
    for header in cpu_native.SOURCE_DIR.glob("*.h"):  # the revision's, else today's
        shown = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:kernels/cpu/{header.name}"],
            capture_output=True,
        )
        (workdir / header.name).write_bytes(
            shown.stdout if shown.returncode == 0 else header.read_bytes()
        )
    c_file = workdir / "baseline.c"
    c_file.write_text(source)
    flags = cpu_native.kv_flags(dtype)
    digest = hashlib.sha256(source.encode() + " ".join(flags).encode()).hexdigest()[:12]
    library = workdir / f"baseline-{digest}.so"
    compiler = cpu_native._compiler()
    if compiler is None:
        raise SystemExit("no C compiler: cannot build the baseline kernel")
    subprocess.run(
        [compiler, *cpu_native.FLAGS, *flags, str(c_file), "-o", str(library), "-lm"], check=True
    )
    fn = ctypes.CDLL(str(library)).asyncengine_paged_decode_attention
    fn.restype = ctypes.c_int
    with_options = "softcap" in source
    fn.argtypes = _ARGS_OPTIONS if with_options else _ARGS_PLAIN

    def call(pools: Pools, layer: int, out: torch.Tensor, threads: int) -> int:
        q = pools.q
        head = [q.data_ptr(), q.stride(0), pools.k[layer].data_ptr(), pools.v[layer].data_ptr()]
        head += [pools.block_table.data_ptr(), pools.block_table.stride(0)]
        head += [pools.seq_lens.data_ptr(), q.shape[0], q.shape[1], pools.k[layer].shape[1]]
        head += [q.shape[2], pools.page_size, pools.scale]
        options = [0, pools.softcap] if with_options else []
        tail = [out.data_ptr(), int(q.dtype == torch.bfloat16), threads]
        return int(fn(*head, *options, *tail))

    return call


def seconds_of(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(
    args: argparse.Namespace,
    dtype: torch.dtype,
    batch: int,
    context: int,
    q_dtype: torch.dtype | None = None,
) -> Row:
    pools = Pools(args.layers, batch, context, dtype, args, q_dtype)
    plan = plan_native_decode(
        pools.block_table, pools.seq_lens, pools.page_size, args.heads, pools.k[0]
    )
    if plan is None:
        raise SystemExit("the native decode kernel does not run on this machine")
    current_out = [torch.empty_like(pools.q) for _ in range(args.layers)]

    def current() -> None:
        for i in range(args.layers):
            current_out[i] = native_decode_attention(
                pools.q, pools.k[i], pools.v[i], plan, pools.scale, softcap=pools.softcap
            )

    runs: dict[str, Callable[[], None]] = {"current": current}
    baseline_out = torch.empty_like(pools.q)
    if args.baseline_rev:
        call = compile_baseline(args.baseline_rev, dtype)

        def baseline() -> None:
            for i in range(args.layers):
                if call(pools, i, baseline_out, args.threads) != 0:
                    raise SystemExit("the baseline kernel refused these shapes")

        runs["baseline"] = baseline
    if args.torch:

        def reference() -> None:
            for i in range(args.layers):
                decode_attention(
                    pools.q, pools.k[i], pools.v[i], pools.block_table, pools.seq_lens,
                    pools.page_size, pools.scale,
                )  # fmt: skip

        runs["torch"] = reference
    for run in runs.values():  # warm-up: compiled, paged in
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved: the kernels see the same machine state
        for name, run in runs.items():
            seconds[name].append(seconds_of(run))
    ms = {name: sorted(s)[len(s) // 2] / args.layers * 1000 for name, s in seconds.items()}
    row = Row(
        dtype=str(dtype).removeprefix("torch.") + ("" if q_dtype is None else "-bf16-queries"),
        batch=batch,
        context=context,
        threads=args.threads,
        ms_per_layer=round(ms["current"], 3),
        gb_per_s=round(pools.bytes_per_layer / ms["current"] / 1e6, 1),
    )
    if "baseline" in ms:
        row.baseline_ms_per_layer = round(ms["baseline"], 3)
        row.speedup_vs_baseline = round(ms["baseline"] / ms["current"], 2)
        diff = (current_out[-1].float() - baseline_out.float()).abs().max().item()
        row.max_abs_diff_vs_baseline = float(f"{diff:.3g}")
    if "torch" in ms:
        row.torch_ms_per_layer = round(ms["torch"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x257,128x257,32x2049", help="batch x context, ...")
    parser.add_argument(
        "--dtypes",
        default="bf16,fp32",
        help="of bf16, fp32, fp16, int8, int8-bf16 (an int8 pool, bfloat16 queries)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--layers", type=int, default=30, help="distinct pools (the model's)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--softcap", type=float, default=0.0, help="attention soft-cap (Gemma 2's 50); 0: none"
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--baseline-rev", help="git revision of the kernel to compare with")
    parser.add_argument("--torch", action="store_true", help="time the torch reference too")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
        "bf16": (torch.bfloat16, None),
        "fp32": (torch.float32, None),
        "fp16": (torch.float16, None),
        "int8": (torch.int8, None),
        "int8-bf16": (torch.int8, torch.bfloat16),
    }
    rows = []
    print(
        f"native CPU decode attention, {args.layers} pools, heads {args.heads}/{args.kv_heads}, "
        f"head_dim {args.head_dim}, page {args.page_size}, {args.threads} threads"
    )
    print("dtype  batch  ctx     ms/layer   GB/s  baseline ms  x baseline  max diff  torch ms")
    for name in args.dtypes.split(","):
        for shape in args.shapes.split(","):
            batch, context = (int(v) for v in shape.split("x"))
            pool_dtype, q_dtype = dtypes[name]
            row = measure(args, pool_dtype, batch, context, q_dtype)
            rows.append(row)
            print(
                f"{name:5s} {batch:6d} {context:5d} {row.ms_per_layer:11.3f} {row.gb_per_s:6.1f} "
                f"{row.baseline_ms_per_layer or '':>12} {row.speedup_vs_baseline or '':>11} "
                f"{row.max_abs_diff_vs_baseline if row.max_abs_diff_vs_baseline is not None else '':>9} "
                f"{row.torch_ms_per_layer or '':>9}"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    run_main(main)
