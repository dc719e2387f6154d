#!/usr/bin/env python
"""lm-evaluation-harness through our server against its own Hugging Face backend: the same
model, the same task, the same harness; the accuracies must be equal, and the wall times are
compared.

    .venv/bin/python scripts/bench_lm_eval.py                       # smollm2-135m, float32
    .venv/bin/python scripts/bench_lm_eval.py --limit 20 --out bench_results/lm_eval.json
    .venv/bin/python scripts/bench_lm_eval.py --repeats 3                # medians of 3 rounds

The figures in docs/BENCHMARKS.md (the whole task, zero-shot and 3-shot):

    .venv/bin/python scripts/bench_lm_eval.py --hf-without-logits-cache --out bench_results/lm_eval_0shot.json
    .venv/bin/python scripts/bench_lm_eval.py --num-fewshot 3 --hf-without-logits-cache --out bench_results/lm_eval_3shot.json

The harness settings are those its documentation gives for ``local-completions`` (16 prompts a
request, one request in flight) and the same batch size for the HF backend.

It starts ``asyncengine serve`` on 127.0.0.1 (``--dtype float32``: the HF backend's dtype) and
runs, one after the other, in child processes:

    lm_eval --model local-completions --model_args model=M,base_url=http://127.0.0.1:P/v1/completions,tokenizer=M,tokenized_requests=True --batch_size B --tasks asyncengine_mc --include_path scripts/lm_eval_tasks
    lm_eval --model hf --model_args pretrained=M,dtype=float32 --device cpu --batch_size B --tasks asyncengine_mc --include_path scripts/lm_eval_tasks

``asyncengine_mc`` is the local multiple-choice task in scripts/lm_eval_tasks (no download).
``--hf-without-logits-cache`` adds a third run: the HF backend with ``logits_cache=False``
(by default it computes one forward for the choices of a question whose continuations are one
token and differ only there; the server is sent every prompt whole, and takes the whole KV
pages of a context scored before, with their scores, from its prefix and prompt score caches).
The server's counters of what it took from those caches are printed too.
Each lm_eval run is timed whole (the child's wall time: importing the harness, loading the
tokenizer or model, every request), by the harness's own ``total_evaluation_time_seconds``, and
by its request loop alone (its progress bar: requests sent and answered, or the HF forwards),
the part the backends differ in (~20 s of a quiet run is the harness's own start-up, both ways);
our server's start-up is reported apart. ``--repeats N`` runs N rounds (a fresh server, lm_eval
through it, then the HF backend) and compares medians. Exit status 1 when the accuracies differ. Prints a
table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # systems.py beside this script

from systems import LaunchedServer  # noqa: E402

from asyncengine.script_main import run_main  # noqa: E402

TASK = "asyncengine_mc"
TASKS_DIR = "scripts/lm_eval_tasks"


@dataclass(slots=True)
class HarnessRun:
    backend: str  # "asyncengine" (local-completions through our server) or "hf"
    acc: float
    acc_norm: float
    samples: int
    requests: int  # loglikelihood requests: one per choice
    wall_seconds: float  # the lm_eval child process, whole
    evaluation_seconds: float  # the harness's total_evaluation_time_seconds
    request_seconds: float | None  # its request loop alone, as its progress bar timed it
    repeat: int = 0


# tqdm's last line for lm-eval's request loop: "Requesting API: 100%|...| 544/544 [00:24<00:00,
# 22.59it/s]" (local-completions) or "Running loglikelihood requests: ..." (hf).
PROGRESS = re.compile(
    r"(?:Requesting API|Running loglikelihood requests): 100%\|[^|]*\| (\d+)/\1 "
    r"\[(?:(\d+):)?(\d+):(\d+)<[^,]*, *([0-9.]+)(it/s|s/it)\]"
)


def request_seconds(log_text: str) -> float | None:
    """The harness's request loop in seconds (all requests sent and answered, or all HF
    forwards), from its finished progress bar: count / rate, finer than the bar's mm:ss."""
    found = PROGRESS.findall(log_text.replace("\r", "\n"))
    if not found:
        return None
    count, hours, minutes, seconds, rate, unit = found[-1]
    if float(rate) == 0.0:
        return float(hours or 0) * 3600 + float(minutes) * 60 + float(seconds)
    return int(count) / float(rate) if unit == "it/s" else int(count) * float(rate)


def lm_eval_command(
    model_args: str, backend: str, batch_size: int, limit: int | None, num_fewshot: int = 0
) -> list[str]:
    command = [
        str(Path(sys.executable).with_name("lm_eval")),
        "--model",
        backend,
        "--model_args",
        model_args,
        "--batch_size",
        str(batch_size),
        "--tasks",
        TASK,
        "--include_path",
        TASKS_DIR,
    ]
    if backend == "hf":
        command += ["--device", "cpu"]
    if limit is not None:
        command += ["--limit", str(limit)]
    if num_fewshot:
        command += ["--num_fewshot", str(num_fewshot)]
    return command


def run_harness(
    name: str, command: list[str], out_dir: Path, log_path: Path, repeat: int = 0
) -> HarnessRun:
    """One lm_eval run in a child process (offline: nothing is fetched), its results read
    back from ``--output_path``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [*command, "--output_path", str(out_dir)]
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        raise SystemExit(f"lm_eval ({name}) exited with {done.returncode}:\n" + "\n".join(tail))
    (path,) = sorted(out_dir.rglob("results_*.json"))
    results = json.loads(path.read_text())
    task = results["results"][TASK]
    samples = results["n-samples"][TASK]["effective"]
    return HarnessRun(
        backend=name,
        acc=float(task["acc,none"]),
        acc_norm=float(task["acc_norm,none"]),
        samples=int(samples),
        requests=0,
        wall_seconds=wall,
        evaluation_seconds=float(results["total_evaluation_time_seconds"]),
        request_seconds=request_seconds(log_path.read_text(errors="replace")),
        repeat=repeat,
    )


def server_counters(base_url: str) -> dict[str, float]:
    """The server's prompt and cache counters from /metrics: how much of the prompts it took
    from its caches."""
    names = {
        "asyncengine_prompt_tokens_total": "prompt_tokens",
        "asyncengine_cache_hit_tokens_total": "cache_hit_tokens",
        "asyncengine_prompt_score_cache_hit_positions_total": "prompt_score_hit_positions",
    }
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            counters[names[name]] = float(value)
    return counters


def count_requests(limit: int | None) -> int:
    lines = (ROOT / TASKS_DIR / TASK / f"{TASK}.jsonl").read_text().splitlines()
    docs = [json.loads(line) for line in lines][: limit if limit is not None else None]
    return sum(len(doc["choices"]) for doc in docs)


def median_of(runs: list[HarnessRun], field: str) -> float:
    return statistics.median(float(getattr(run, field)) for run in runs)


def request_speedup(ours: list[HarnessRun], theirs: list[HarnessRun]) -> float | None:
    """HF's request loop over ours (medians), where both progress bars were read."""
    mine = [run.request_seconds for run in ours if run.request_seconds is not None]
    hf = [run.request_seconds for run in theirs if run.request_seconds is not None]
    if len(mine) != len(ours) or len(hf) != len(theirs) or min(mine) <= 0:
        return None
    return statistics.median(hf) / statistics.median(mine)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} CPUs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default smollm2-135m)")
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--batch-size", type=int, default=16, help="both backends' batch size")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="batches local-completions keeps in flight (num_concurrent); the server batches them",
    )
    parser.add_argument(
        "--num-fewshot",
        type=int,
        default=0,
        help="examples before each question (lm_eval --num_fewshot): longer shared contexts",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of (fresh server + lm_eval through it, then the HF backend); medians",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--serve-arg", action="append", default=[], help="more serve flags")
    parser.add_argument(
        "--hf-without-logits-cache",
        action="store_true",
        help="also run the HF backend with logits_cache=False",
    )
    args = parser.parse_args()
    if args.model is None:
        import torch

        from asyncengine.executor.loader import resolve_model

        model = str(resolve_model("smollm2-135m", torch.float32))
    else:
        model = str(Path(args.model).resolve())
    load_before = load_average()
    work = Path(tempfile.mkdtemp(prefix="bench_lm_eval_"))
    runs: list[HarnessRun] = []
    startups: list[float] = []
    counters: dict[str, float] = {}
    for repeat in range(args.repeats):
        # A fresh server each repeat: a warm one would take every prompt from its caches.
        server = LaunchedServer(
            ["--model", model, "--dtype", "float32", "--log-interval", "0", *args.serve_arg],
            args.startup_timeout,
            work / f"server_{repeat}.log",
        )
        server.start()
        try:
            runs.append(
                run_harness(
                    "asyncengine",
                    lm_eval_command(
                        f"model={model},base_url={server.base_url}/v1/completions,"
                        f"tokenizer={model},tokenized_requests=True,"
                        f"num_concurrent={args.concurrency},max_retries=1",
                        "local-completions",
                        args.batch_size,
                        args.limit,
                        args.num_fewshot,
                    ),
                    work / f"asyncengine_{repeat}",
                    work / f"lm_eval_asyncengine_{repeat}.log",
                    repeat,
                )
            )
            counters = server_counters(server.base_url)
        finally:
            server.stop()
        assert server.startup_seconds is not None
        startups.append(server.startup_seconds)
        hf_runs = [("hf", f"pretrained={model},dtype=float32")]
        if args.hf_without_logits_cache:
            hf_runs.append(("hf-no-cache", f"pretrained={model},dtype=float32,logits_cache=False"))
        for name, model_args in hf_runs:
            runs.append(
                run_harness(
                    name,
                    lm_eval_command(
                        model_args, "hf", args.batch_size, args.limit, args.num_fewshot
                    ),
                    work / f"{name}_{repeat}",
                    work / f"lm_eval_{name}_{repeat}.log",
                    repeat,
                )
            )
    requests = count_requests(args.limit)
    for run in runs:
        run.requests = requests
    ours = [run for run in runs if run.backend == "asyncengine"]
    theirs = [run for run in runs if run.backend == "hf"]
    report = {
        "model": model,
        "task": TASK,
        "batch_size": args.batch_size,
        "concurrency": args.concurrency,
        "limit": args.limit,
        "num_fewshot": args.num_fewshot,
        "repeats": args.repeats,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "server_startup_seconds": statistics.median(startups),
        "server_counters": counters,
        "runs": [asdict(run) for run in runs],
        "wall_speedup": median_of(theirs, "wall_seconds") / median_of(ours, "wall_seconds"),
        "evaluation_speedup": median_of(theirs, "evaluation_seconds")
        / median_of(ours, "evaluation_seconds"),
        "request_speedup": request_speedup(ours, theirs),
        "equal_accuracy": all((r.acc, r.acc_norm) == (ours[0].acc, ours[0].acc_norm) for r in runs),
    }
    print(
        f"lm-eval {TASK} ({ours[0].samples} questions, {args.num_fewshot}-shot, {requests} "
        f"loglikelihood requests), {model}"
    )
    print(f"load average (1/5/15 min): before {load_before}, after {report['load_average_after']}")
    header = (
        f"{'backend':<12} {'round':>5} {'acc':>7} {'acc_norm':>9} {'lm_eval wall s':>15} "
        f"{'eval s':>8} {'requests s':>11}"
    )
    print(header)
    for run in runs:
        phase = "-" if run.request_seconds is None else f"{run.request_seconds:.1f}"
        print(
            f"{run.backend:<12} {run.repeat:>5} {run.acc:>7.4f} {run.acc_norm:>9.4f} "
            f"{run.wall_seconds:>15.1f} {run.evaluation_seconds:>8.1f} {phase:>11}"
        )
    phase_ratio = report["request_speedup"]
    phase_text = "" if phase_ratio is None else f", {phase_ratio:.2f}x (the request loop alone)"
    print(
        f"asyncengine is {report['wall_speedup']:.2f}x the HF backend's speed (lm_eval wall, "
        f"median of {args.repeats}), {report['evaluation_speedup']:.2f}x (evaluation)"
        f"{phase_text}; server start-up {report['server_startup_seconds']:.1f}s apart; "
        f"accuracies equal: {report['equal_accuracy']}"
    )
    print(
        "server: {:.0f} prompt tokens, {:.0f} from the prefix cache, {:.0f} scored positions "
        "from the prompt score cache".format(
            counters.get("prompt_tokens", 0),
            counters.get("cache_hit_tokens", 0),
            counters.get("prompt_score_hit_positions", 0),
        )
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["equal_accuracy"] else 1


if __name__ == "__main__":
    run_main(main)
