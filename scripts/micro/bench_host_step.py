#!/usr/bin/env python
"""Host milliseconds per engine step, with a forward that costs nothing: what a GPU would wait on.

The real ``AsyncEngine`` (scheduler, policy, radix cache, commit, stop checks, detokenizer,
streams) drives a stand-in executor that does an executor's host work and no model: it applies
the plan's page writes, turns the plan into the forward's tensors (``build_forward_batch``, on
the CPU), fills in and keeps the deferred decode inputs as the GPU executor does, and picks the
tokens from a stand-in logits tensor of ``--logits-width`` columns (the sampled column offset
into ordinary text tokens): a plain greedy step's argmax is device work on a GPU (the captured
step's last kernel), so there the host only checks that every row is plain greedy; other steps
go through the real ``Sampler``. Every request streams its deltas to a consumer task, as an
HTTP handler would.

``--device-ms X`` gives the stand-in a device: each step, once launched, takes X ms of a
timeline of its own (X: the device's measured step, e.g. 1.6 for a batch-256 decode step of the
embedded model on an H200), starting when both its launch and the step before it are done, and
waiting for its output sleeps with the GIL released, as waiting on a GPU does. The stand-in
launches in two halves as the GPU executor does (``launch``: the host half, then the wait), and
``--overlap`` turns ``enable_overlap_schedule`` on: the engine plans and launches step N+1
while the "device" runs step N (scheduler/plan_ahead.py). Together they show how much of the
host work hides under the device: the report gives each scenario's step wall time against
max(host CPU ms per step, device ms), which overlap should approach. (With overlap, parts of
one step run during the next step's forward, so the per-part split is charged to whichever
step was scheduled last.)

Scenarios: ``decode`` at batch B (B requests of 16-token prompts and long outputs, all running
at once; the steps with exactly B decodes and no prefill are measured), and ``mixed`` (1,024
requests through 256 running slots, random prompt and output lengths, so most steps carry a
prefill chunk beside the decodes). For each, host ms per step split by part, timed where the
parts run: schedule + plan (``core.launch``), plan -> tensors, sampling, land (``core.land``:
commit, every stop check, detokenizing and stop strings), stream (step events into stream
updates), and the rest of the loop (asyncio, the stream consumers, the forward thread's
hand-off).

    .venv/bin/python scripts/micro/bench_host_step.py                 # table, JSON, last line the figure
    .venv/bin/python scripts/micro/bench_host_step.py --batches 256 --out bench_results/host.json
    .venv/bin/python scripts/micro/bench_host_step.py --batches 256 --mixed-requests 0 \
        --device-ms 1.6 --overlap                                      # wall vs max(host, device)

``--before DIR`` measures another checkout beside this one (e.g. main's, for a change's
before/after): each scenario runs there (its own ``.venv`` and script, a subprocess), then
here, alternately, so that both see the same load; the report adds the two CPU figures per
step and per running request, before and after. How the host work grows with the batch (a
steady decode step changes nothing but each request's one token) shows in the per-request
figure across ``--batches 64,256,1024``:

    .venv/bin/python scripts/micro/bench_host_step.py --batches 64,256,1024 --mixed-requests 0 \
        --before /work/main

The last line printed is ``host_ms_per_step <ms at decode batch 256>``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

from asyncengine.api.event_loop import run as run_loop
from asyncengine.cache.page_table import PageTable
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, StepOutput, TokenLogprobs
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.executor_api import KVLayout, ModelSpec
from asyncengine.executor.deferred_inputs import LastSampled
from asyncengine.executor.forward_batch import build_forward_batch
from asyncengine.executor.sampler import Sampler, greedy_tokens

TOKEN_OFFSET = 1000  # stand-in logits column c samples token TOKEN_OFFSET + c (ordinary text)


LAND = "land (commit, stops, detokenize)"
STREAM = "stream"


class StepClock:
    """Per-step host time by part. A step runs from one ``schedule`` call to the next; parts
    timed in between are charged to the step whose plan was scheduled last."""

    def __init__(self) -> None:
        self.step_start: list[float] = []
        self.step_cpu: list[float] = []  # process CPU seconds (all threads) at each step's start
        self.plans: list[tuple[int, int, int]] = []  # (decodes, extends, extend tokens)
        self.ahead: list[bool] = []  # planned while the step before it was in flight
        self.parts: list[dict[str, float]] = []

    def charge(self, part: str, seconds: float) -> None:
        if self.parts:
            bucket = self.parts[-1]
            bucket[part] = bucket.get(part, 0.0) + seconds

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.charge(part, time.perf_counter() - start)

        return timed

    def wrap_schedule(self, fn: Callable[[], BatchPlan | None]) -> Callable[[], BatchPlan | None]:
        def timed() -> BatchPlan | None:
            start = time.perf_counter()
            plan = fn()
            elapsed = time.perf_counter() - start
            if plan is not None:
                self.step_start.append(start)
                self.step_cpu.append(time.process_time())
                self.plans.append(
                    (len(plan.decodes), len(plan.extends), sum(s.num_tokens for s in plan.extends))
                )
                self.ahead.append(bool(plan.deferred))
                self.parts.append({})
            self.charge("schedule + plan", elapsed)
            return plan

        return timed


class StandInDevice:
    """A device's timeline: each launched step runs ``seconds`` from when both it is launched
    and the step before it is done, apart from the host thread that launched it, as a GPU
    runs a queue of enqueued work; waiting for a step sleeps (GIL released) until it is done."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.free_at = 0.0  # perf_counter when the last launched step is done

    def enqueue(self) -> float:
        """Queue one step now; when it is done."""
        self.free_at = max(self.free_at, time.perf_counter()) + self.seconds
        return self.free_at

    @staticmethod
    def wait(done: float) -> None:
        left = done - time.perf_counter()
        if left > 0:
            time.sleep(left)


class StandInExecutor:
    """An executor's host work without a model (see the module docstring)."""

    def __init__(
        self, vocab_size: int, eos_token_ids: tuple[int, ...], width: int, forward_ms: float = 0.0
    ) -> None:
        self.spec = ModelSpec(
            max_model_len=32768,
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids,
            kv_bytes_per_token=1,
        )
        self.sampler = Sampler(eos_token_ids)
        self.defers_inputs = True  # as a GPU executor: plans may be made ahead (overlap)
        self.width = width
        self.device = StandInDevice(forward_ms / 1e3)  # a GPU's forward: a wait, GIL free
        self.clock: StepClock | None = None
        gen = torch.Generator().manual_seed(0)
        self._logits = torch.randn(4096, width, generator=gen)

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        return None

    def bind(self, layout: KVLayout) -> None:
        self.layout = layout
        self.table = PageTable(layout.max_rows, layout.max_pages_per_row)
        self.last_sampled = LastSampled(layout.max_rows, _CPU)

    def _timed(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args)
        if self.clock is not None:
            self.clock.charge(part, time.perf_counter() - start)
        return result

    def _prepare(self, plan: BatchPlan) -> Any:
        self.table.apply(plan.page_writes)
        batch = build_forward_batch(plan, self.table.array, self.layout.page_size, _CPU)
        self.last_sampled.fill(batch)
        return batch

    def _sample(self, plan: BatchPlan) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """The step's tokens: a plain greedy step's argmax is device work on a GPU (the
        captured step's last kernel: the host only checks that the rows are plain greedy),
        any other goes through the sampler on the host, as there."""
        rows = len(plan.sampling)
        offset = plan.step % (self._logits.shape[0] - rows + 1)
        logits = self._logits[offset : offset + rows]
        if self.sampler.plain_greedy(plan.sampling):
            return greedy_tokens(logits) + TOKEN_OFFSET, [None] * rows
        ids, logprobs = self.sampler.sample(logits, plan.sampling)
        return torch.tensor(ids, dtype=torch.int64) + TOKEN_OFFSET, list(logprobs)

    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        """The host half of a step, as the model executor's ``launch`` on a GPU: the plan
        turned into tensors, the tokens picked and kept for the next plan's deferred inputs,
        the step queued on the device; returns the wait for its output."""
        start = time.perf_counter()
        batch = self._timed("plan -> tensors", self._prepare, plan)
        tokens: torch.Tensor | None = None
        logprobs: list[TokenLogprobs | None] = []
        if plan.sampling:
            tokens, logprobs = self._timed("sampling", self._sample, plan)
            self.last_sampled.record(batch, tokens)
        done = self.device.enqueue()

        def collect() -> StepOutput:
            self.device.wait(done)
            ids = [] if tokens is None else tokens.tolist()
            return StepOutput(ids, logprobs, time.perf_counter() - start)

        return collect

    def execute(self, plan: BatchPlan) -> StepOutput:
        return self.launch(plan)()


_CPU = torch.device("cpu")


@dataclass(slots=True)
class Scenario:
    name: str
    batch: int  # running requests at most (and, for decode, the batch measured)
    prompt_lens: list[int]
    output_lens: list[int]
    decode_only: bool  # measure only the steps with exactly `batch` decodes and no prefill


@dataclass(slots=True)
class Row:
    scenario: str
    batch: int
    steps_measured: int
    host_ms_per_step: float  # median over the measured steps
    host_ms_mean: float
    cpu_ms_per_step: float  # median process CPU time per measured step (robust to others' load)
    parts_ms: dict[str, float] = field(default_factory=dict)  # mean per measured step
    mean_decodes: float = 0.0
    mean_extend_tokens: float = 0.0
    device_ms: float = 0.0  # the stand-in forward's wait
    planned_ahead: float = 0.0  # share of the measured steps planned while the last one ran
    # median step wall over max(host CPU ms, device ms): 1.0 is every bit of host work hidden
    wall_over_bound: float = 0.0


def decode_scenario(batch: int, output_len: int) -> Scenario:
    return Scenario(f"decode B={batch}", batch, [16] * batch, [output_len] * batch, True)


def mixed_scenario(num_requests: int, batch: int, seed: int) -> Scenario:
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(180), 0.6, num_requests), 8, 1024).astype(int)
    outputs = np.clip(rng.lognormal(np.log(60), 0.6, num_requests), 4, 256).astype(int)
    return Scenario(f"mixed ({num_requests} req)", batch, prompts.tolist(), outputs.tolist(), False)


async def run_scenario(
    scenario: Scenario, tokenizer: Any, width: int, forward_ms: float, overlap: bool
) -> Row:
    from asyncengine.api.engine import AsyncEngine

    executor = StandInExecutor(
        tokenizer.vocab_size, tuple(tokenizer.eos_token_ids), width, forward_ms
    )
    config = EngineConfig(
        enable_overlap_schedule=overlap,
        log_interval=0,
        max_running_requests=scenario.batch,
        kv_cache_tokens=max(262144, sum(scenario.prompt_lens) + sum(scenario.output_lens)),
        max_waiting_requests=len(scenario.prompt_lens) + 16,
    )
    clock = StepClock()
    rng = np.random.default_rng(1)
    async with AsyncEngine(config, executor=executor, tokenizer=tokenizer) as engine:
        warm = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        await engine.generate(list(range(TOKEN_OFFSET, TOKEN_OFFSET + 16)), warm)
        core = engine.core
        assert core is not None
        core.launch = clock.wrap_schedule(core.launch)  # type: ignore[method-assign]
        core.land = clock.wrap(LAND, core.land)  # type: ignore[method-assign]
        engine.streams.publish = clock.wrap(STREAM, engine.streams.publish)  # type: ignore[method-assign]
        executor.clock = clock

        async def consume(prompt_len: int, output_len: int) -> int:
            prompt = rng.integers(TOKEN_OFFSET, TOKEN_OFFSET + 20000, prompt_len).tolist()
            params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
            chars = 0
            async for delta in engine.stream(prompt, params):
                chars += len(delta.text)
            return chars

        start = time.perf_counter()
        await asyncio.gather(
            *(
                consume(p, o)
                for p, o in zip(scenario.prompt_lens, scenario.output_lens, strict=True)
            )
        )
        end, end_cpu = time.perf_counter(), time.process_time()
    bounds = [*clock.step_start[1:], end]
    durations = [b - a for a, b in zip(clock.step_start, bounds, strict=True)]
    cpu_bounds = [*clock.step_cpu[1:], end_cpu]
    cpu = [b - a for a, b in zip(clock.step_cpu, cpu_bounds, strict=True)]
    keep = [
        i
        for i, (decodes, extends, _) in enumerate(clock.plans)
        if not scenario.decode_only or (decodes == scenario.batch and extends == 0)
    ]
    if scenario.decode_only:
        keep = keep[1:-1]  # the first and last such steps border prefill and teardown
    measured = [durations[i] for i in keep]
    totals: dict[str, float] = collections.defaultdict(float)
    for i in keep:
        for part, seconds in clock.parts[i].items():
            totals[part] += seconds
    n = max(len(keep), 1)
    parts_ms = {part: seconds / n * 1e3 for part, seconds in totals.items()}
    parts_ms["loop: other (asyncio, streams)"] = max(
        0.0, sum(measured) / n * 1e3 - sum(parts_ms.values())
    )
    del start
    wall_ms = statistics.median(measured) * 1e3 if measured else float("nan")
    cpu_ms = statistics.median(cpu[i] for i in keep) * 1e3 if keep else float("nan")
    return Row(
        scenario=scenario.name,
        batch=scenario.batch,
        steps_measured=len(measured),
        host_ms_per_step=wall_ms,
        host_ms_mean=sum(measured) / n * 1e3,
        cpu_ms_per_step=cpu_ms,
        parts_ms=parts_ms,
        mean_decodes=sum(clock.plans[i][0] for i in keep) / n,
        mean_extend_tokens=sum(clock.plans[i][2] for i in keep) / n,
        device_ms=forward_ms,
        planned_ahead=sum(clock.ahead[i] for i in keep) / n,
        wall_over_bound=wall_ms / max(cpu_ms, forward_ms),
    )


PART_ORDER = (
    "schedule + plan",
    "plan -> tensors",
    "sampling",
    LAND,
    STREAM,
    "loop: other (asyncio, streams)",
)


def table(rows: list[Row]) -> str:
    head = (
        f"{'scenario':<20}{'steps':>6}{'ms/step':>9}{'mean':>8}{'CPU ms':>8}{'device':>8}"
        f"{'ahead':>7}{'wall/bound':>11}" + "".join(f"{p.split(' (')[0]:>22}" for p in PART_ORDER)
    )
    lines = [head]
    for r in rows:
        parts = "".join(f"{r.parts_ms.get(part, 0.0):>22.3f}" for part in PART_ORDER)
        lines.append(
            f"{r.scenario:<20}{r.steps_measured:>6}{r.host_ms_per_step:>9.3f}{r.host_ms_mean:>8.3f}"
            f"{r.cpu_ms_per_step:>8.3f}{r.device_ms:>8.3f}{r.planned_ahead:>7.0%}"
            f"{r.wall_over_bound:>11.2f}" + parts
        )
    return "\n".join(lines)


def default_tokenizer_dir() -> Path:
    from asyncengine.executor.loader.default_model import DEFAULT_MODEL, tokenizer_dir

    return tokenizer_dir(DEFAULT_MODEL)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256,512", help="decode batch sizes")
    parser.add_argument("--output-len", type=int, default=64, help="decode scenarios' outputs")
    parser.add_argument("--mixed-requests", type=int, default=1024, help="0: no mixed scenario")
    parser.add_argument("--mixed-batch", type=int, default=256)
    parser.add_argument("--logits-width", type=int, default=256)
    parser.add_argument(
        "--device-ms",
        "--forward-ms",
        dest="forward_ms",
        type=float,
        default=0.0,
        help="the stand-in forward waits this long, GIL released (a GPU's step); 0: none",
    )
    parser.add_argument(
        "--overlap", action="store_true", help="enable_overlap_schedule (default: off)"
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="a directory with tokenizer.json "
        "(default: the embedded SmolLM2's)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="batches 1,256; 256 mixed requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--before", type=Path, default=None,
        help="another checkout to measure beside this one, scenario by scenario (A/B)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.mixed_requests = "1,256", 256
    from asyncengine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.tokenizer or default_tokenizer_dir())
    torch.set_num_threads(1)  # the host side: one thread, as the engine's loop has
    batches = [int(b) for b in args.batches.split(",") if b]
    scenarios = [decode_scenario(b, args.output_len) for b in batches]
    if args.mixed_requests:
        scenarios.append(mixed_scenario(args.mixed_requests, args.mixed_batch, args.seed))
    load_start = os.getloadavg()
    # the engine's own runner (uvloop when installed), as `asyncengine serve` runs
    rows: list[Row] = []
    before: list[dict[str, Any]] = []
    for scenario in scenarios:
        if args.before is not None:
            before.append(run_before(args.before, scenario, args))
        rows.append(
            run_loop(
                run_scenario(scenario, tokenizer, args.logits_width, args.forward_ms, args.overlap)
            )
        )
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": [r.__dict__ if not hasattr(r, "__slots__") else _row_dict(r) for r in rows],
    }
    at_256 = next((r for r in rows if r.scenario == "decode B=256"), None)
    result["host_ms_per_step_256"] = at_256.host_ms_per_step if at_256 else None
    result["cpu_ms_per_step_256"] = at_256.cpu_ms_per_step if at_256 else None
    print(table(rows))
    if before:
        result["before"] = {"checkout": str(args.before), "rows": before}
        print(before_after(rows, before, args.before))
    print(f"load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    if at_256 is not None:
        if args.forward_ms:
            print(
                f"decode B=256: step wall {at_256.host_ms_per_step:.3f} ms, host CPU "
                f"{at_256.cpu_ms_per_step:.3f} ms, device {args.forward_ms:.3f} ms: "
                f"{at_256.wall_over_bound:.2f}x max(host, device), "
                f"{at_256.planned_ahead:.0%} of steps planned ahead"
            )
        print(f"host_ms_per_step {at_256.host_ms_per_step:.3f}")
    return result


def run_before(checkout: Path, scenario: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    """``scenario`` measured by ``checkout``'s own copy of this script, in its own venv: the
    row it reports (a JSON row of the same fields)."""
    python = checkout / ".venv" / "bin" / "python"
    script = checkout / "scripts" / "micro" / "bench_host_step.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        flags = [
            f"--logits-width={args.logits_width}",
            f"--device-ms={args.forward_ms}",
            f"--seed={args.seed}",
            f"--out={out}",
            *(["--overlap"] if args.overlap else []),
            *(["--tokenizer", str(args.tokenizer)] if args.tokenizer else []),
        ]
        if scenario.decode_only:
            flags += [f"--batches={scenario.batch}", "--mixed-requests=0"]
            flags += [f"--output-len={scenario.output_lens[0]}"]
        else:
            flags += ["--batches=", f"--mixed-requests={len(scenario.prompt_lens)}"]
            flags += [f"--mixed-batch={scenario.batch}"]
        subprocess.run(
            [str(python), str(script), *flags],
            cwd=checkout,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    (row,) = rows
    return row


def before_after(rows: list[Row], before: list[dict[str, Any]], checkout: Path) -> str:
    """Host CPU ms per step and microseconds per running request, here against ``checkout``."""
    lines = [
        f"before: {checkout}; after: this checkout (CPU ms per step, median; us per request)",
        f"{'scenario':<20}{'before ms':>10}{'after ms':>10}{'after/before':>13}"
        f"{'before us/req':>14}{'after us/req':>13}",
    ]
    for after, old in zip(rows, before, strict=True):
        requests = max(after.mean_decodes, 1.0)
        old_ms = float(old["cpu_ms_per_step"])
        lines.append(
            f"{after.scenario:<20}{old_ms:>10.3f}{after.cpu_ms_per_step:>10.3f}"
            f"{after.cpu_ms_per_step / old_ms:>13.2f}{old_ms / requests * 1e3:>14.2f}"
            f"{after.cpu_ms_per_step / requests * 1e3:>13.2f}"
        )
    return "\n".join(lines)


def _row_dict(row: Row) -> dict[str, Any]:
    return {name: getattr(row, name) for name in row.__slots__}  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
