"""Head-of-line skipping (vLLM #33499): a waiting request whose KV pages do not fit blocks
every request behind it under strict order; skipping it lets the small ones behind it run.

A stream of short prompts with long answers keeps the KV pool busy (long-lived decodes); now
and then a long prompt arrives, which does not fit until enough running requests finish. With ``kv_blocked_skips = 0`` (strict
order, our default and vLLM's before the PR) every short request that arrives meanwhile waits
behind it; with skipping, admission passes over the long one and admits them. What the PR does
not measure is the price: the long request may wait longer, since the short ones it lets by
take the pages that free up.
"""

from __future__ import annotations

import numpy as np

from asyncengine.bench.records import RequestRecord
from asyncengine.common.config import EngineConfig
from asyncengine.sim.reproductions.base import (
    Claim,
    Outcome,
    markdown_table,
    run_workload,
    seconds,
)
from asyncengine.workloads.arrivals import Arrivals
from asyncengine.workloads.generators import _tokens
from asyncengine.workloads.trace import WorkloadRequest


def short_and_long(
    short_rate: float,
    duration: float,
    short_prompt: int,
    short_output: int,
    long_every: float,
    long_prompt: int,
    long_output: int,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Short requests Poisson at ``short_rate`` and one long request every ``long_every``
    seconds (the first after one interval), for ``duration`` seconds."""
    rng = np.random.default_rng(seed)
    count = int(short_rate * duration)
    times = Arrivals("poisson", rate=short_rate).times(count, seed)
    items = [
        WorkloadRequest(f"short-{i:05d}", t, _tokens(rng, short_prompt, vocab_size), short_output)
        for i, t in enumerate(times)
    ]
    for i, t in enumerate(np.arange(long_every, duration, long_every).tolist()):
        items.append(
            WorkloadRequest(f"long-{i:03d}", t, _tokens(rng, long_prompt, vocab_size), long_output)
        )
    items.sort(key=lambda w: (w.arrival_time, w.rid))
    return items


def _ttfts(records: list[RequestRecord], prefix: str) -> np.ndarray:
    return np.asarray(
        [r.ttft for r in records if r.rid.startswith(prefix) and r.ttft is not None], dtype=float
    )


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


class HeadOfLineSkip:
    name = "hol-skip"
    title = "Head-of-line skipping of a KV-blocked request (vLLM #33499)"
    claim = Claim(
        text=(
            "A KV-heavy request at the head of the waiting queue that cannot get its KV blocks "
            "stops admission for every request behind it, including light ones that would fit; "
            "skipping it (admitting the light ones) removes that wait from their latency, "
            "the tail above all."
        ),
        source="vLLM pull request #33499 (for issue #31731)",
        url="https://github.com/vllm-project/vllm/pull/33499",
    )

    def run(self, real: bool) -> Outcome:
        if real:
            shape = dict(short_rate=1.5, duration=40.0, short_prompt=32, short_output=96,
                         long_every=10.0, long_prompt=1024, long_output=8)  # fmt: skip
            pool = 2048
        else:
            shape = dict(short_rate=0.9, duration=300.0, short_prompt=64, short_output=256,
                         long_every=30.0, long_prompt=3072, long_output=16)  # fmt: skip
            pool = 8192
        workload = short_and_long(**shape)  # type: ignore[arg-type]
        base = EngineConfig(kv_cache_tokens=pool, log_interval=0.0)
        variants = {
            "strict order (`kv_blocked_skips = 0`)": 0,
            "skip (`kv_blocked_skips = 128`)": 128,
        }
        rows, numbers = [], {}
        for label, skips in variants.items():
            run = run_workload(label, base.replace(kv_blocked_skips=skips), workload, real=real)
            short, long = _ttfts(run.records, "short-"), _ttfts(run.records, "long-")
            blocked = run.stats.get("admission_blocked", {}).get("kv_reservation", 0)
            numbers[str(skips)] = {
                "short_ttft_p50": _pct(short, 50),
                "short_ttft_p99": _pct(short, 99),
                "short_ttft_max": _pct(short, 100),
                "long_ttft_p50": _pct(long, 50),
                "long_ttft_max": _pct(long, 100),
                "output_throughput": run.summary.output_throughput,
                "completed": run.summary.num_completed,
                "kv_blocked_steps": blocked,
            }
            n = numbers[str(skips)]
            rows.append([
                label, seconds(n["short_ttft_p50"]), seconds(n["short_ttft_p99"]),
                seconds(n["short_ttft_max"]), seconds(n["long_ttft_p50"]),
                seconds(n["long_ttft_max"]), f"{n['output_throughput']:.1f}", str(blocked),
            ])  # fmt: skip
        strict, skip = numbers["0"], numbers["128"]
        holds = skip["short_ttft_p99"] < 0.8 * strict["short_ttft_p99"]
        setting = (
            f"Short requests ({shape['short_prompt']} prompt, {shape['short_output']} output "
            f"tokens) Poisson at {shape['short_rate']:g} req/s, and every "
            f"{shape['long_every']:g} s a long one ({shape['long_prompt']} prompt, "
            f"{shape['long_output']} output tokens), for {shape['duration']:g} s "
            f"({len(workload)} requests); KV pool {pool} tokens, FCFS, engine defaults "
            "otherwise. The long prompt fits only after several running requests finish."
        )
        table = markdown_table(
            ["admission", "short TTFT p50", "short TTFT p99", "short TTFT max",
             "long TTFT p50", "long TTFT max", "out tok/s", "steps stopped on KV"],
            rows,
        )  # fmt: skip
        verdict = (
            f"Skipping cuts the short requests' TTFT p99 from {seconds(strict['short_ttft_p99'])} "
            f"to {seconds(skip['short_ttft_p99'])} (p50 {seconds(strict['short_ttft_p50'])} -> "
            f"{seconds(skip['short_ttft_p50'])}). The long requests pay: TTFT p50 "
            f"{seconds(strict['long_ttft_p50'])} -> {seconds(skip['long_ttft_p50'])}, max "
            f"{seconds(strict['long_ttft_max'])} -> {seconds(skip['long_ttft_max'])}, because the "
            "short requests let by take the pages the long one waits for. The PR reports the "
            "first effect, not the second; a bound on how often one request may be passed "
            "over would be the next step."
        )
        return Outcome(setting, table, verdict, holds, numbers)
