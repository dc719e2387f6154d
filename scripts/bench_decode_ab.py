"""Two builds of the native decode kernels side by side: a batch-1 step (``forward_logits`` and
greedy sampling) of a baseline against this checkout, in one process, steps alternating.

The baseline's kernels (``cpu_decode_step.c``, ``cpu_quant_matmul.c`` and their headers) are
compiled from another checkout's ``kernels/`` (``--baseline``: e.g. ``git worktree add
/tmp/main main``), and its model is loaded with ``--baseline-env`` set (e.g.
``ASYNCENGINE_HUGEPAGE_WEIGHTS=0`` for main's unpacked weights); each path has its own model and
KV pool, and calls its own libraries. A machine that other work keeps busy slows both alike, so
on a loaded machine read the ratio, and ``--cpu-time`` (this process's CPU time: with one thread
the step's own cost whatever else runs).

    .venv/bin/python scripts/bench_decode_ab.py --baseline /tmp/main --baseline-env \\
        ASYNCENGINE_HUGEPAGE_WEIGHTS=0 --threads 1 --cpu-time
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncengine.common.plan import SamplingInfo
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.loader import DEFAULT_MODEL
from asyncengine.executor.sampler import Sampler
from asyncengine.kernels.cpu import cpu_native, decode_step_native, quant_native
from asyncengine.script_main import run_main
from scripts.bench_decode_step import Bench


def _compile(kernels: Path, name: str, out_dir: Path) -> ctypes.CDLL:
    target = out_dir / f"{name}.so"
    compiler = os.environ.get("CC", "cc")
    command = [compiler, *cpu_native.FLAGS, str(kernels / f"{name}.c"), "-o", str(target), "-lm"]
    subprocess.run(command, check=True)
    return ctypes.CDLL(str(target))


class Libraries:
    """The decode step's and the quantized products' libraries one path calls."""

    def __init__(self, step: ctypes.CDLL, quant: ctypes.CDLL) -> None:
        reference_step = decode_step_native._library()
        if reference_step is None:
            raise RuntimeError("the native decode step library is not available here")
        fn = step.asyncengine_decode_step
        fn.restype = ctypes.c_int
        fn.argtypes = reference_step.asyncengine_decode_step.argtypes
        for name, argtypes in quant_native._SIGNATURES.items():
            getattr(quant, name).restype = None
            getattr(quant, name).argtypes = argtypes
        quant.asyncengine_quant_isa.restype = ctypes.c_char_p
        self.step, self.quant = step, quant

    @contextmanager
    def active(self) -> Iterator[None]:
        saved = decode_step_native._library, quant_native._library
        decode_step_native._library = lambda: self.step  # type: ignore[assignment]
        quant_native._library = lambda isa="native": self.quant  # type: ignore[assignment]
        try:
            yield
        finally:
            decode_step_native._library, quant_native._library = saved  # type: ignore[assignment]


@contextmanager
def _environment(pairs: list[str]) -> Iterator[None]:
    saved = dict(os.environ)
    for pair in pairs:
        key, _, value = pair.partition("=")
        os.environ[key] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the baseline")
    parser.add_argument("--baseline-env", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=64, help="kv length of the request")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    clock: Callable[[], float] = time.process_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    ours_step, ours_quant = decode_step_native._library(), quant_native._library()
    if ours_step is None or ours_quant is None:
        raise RuntimeError("the native kernels are not available here")
    build = Path(tempfile.mkdtemp(prefix="bench_decode_ab-"))
    # the C sources: kernels/cpu/ in this layout, kernels/ in older checkouts
    kernels = next(
        folder
        for folder in (args.baseline / "kernels" / "cpu", args.baseline / "kernels")
        if (folder / "cpu_decode_step.c").exists()
    )
    paths = {
        "baseline": Libraries(
            _compile(kernels, "cpu_decode_step", build),
            _compile(kernels, "cpu_quant_matmul", build),
        ),
        "this checkout": Libraries(ours_step, ours_quant),
    }
    bench_args = argparse.Namespace(
        model=args.model, quantization="auto", context=args.context, batches=[1]
    )
    benches: dict[str, Bench] = {}
    for name, libraries in paths.items():
        env = args.baseline_env if name == "baseline" else []
        with libraries.active(), _environment(env):
            benches[name] = Bench(bench_args)
    sampler = Sampler()
    greedy = [SamplingInfo(SamplingParams(temperature=0.0), [], [])]
    samples: dict[str, list[float]] = {name: [] for name in paths}
    load_start = os.getloadavg()[0]
    with torch.inference_mode():
        for repeat in range(args.repeats + 2):
            for name, libraries in paths.items():
                bench = benches[name]
                plan = bench.plan(1)
                with libraries.active():
                    start = clock()
                    sampler.sample(bench.runner.forward_logits(plan), greedy)
                    if repeat >= 2:  # two rounds warm up
                        samples[name].append((clock() - start) * 1e3)
    rows = {
        name: {"median_ms": statistics.median(v), "min_ms": min(v)} for name, v in samples.items()
    }
    base, ours = rows["baseline"], rows["this checkout"]
    result = {
        "baseline": str(args.baseline),
        "baseline_env": args.baseline_env,
        "threads": torch.get_num_threads(),
        "clock": "CPU" if args.cpu_time else "wall",
        "context": args.context,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "rows": rows,
        "speedup_median": base["median_ms"] / ours["median_ms"],
        "speedup_min": base["min_ms"] / ours["min_ms"],
    }
    print(
        f"batch-1 step, context {args.context}, {result['threads']} threads, {result['clock']} "
        f"time, load {load_start:.2f} -> {result['load_end']:.2f}\n\n"
        "| path | median ms | min ms |\n|---|---:|---:|"
    )
    for name, row in rows.items():
        print(f"| {name} | {row['median_ms']:.2f} | {row['min_ms']:.2f} |")
    print(
        f"\nspeed-up: {result['speedup_median']:.2f}x (medians), "
        f"{result['speedup_min']:.2f}x (minimums)"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run_main(main)
