"""Comparison reports: a markdown table and matplotlib figures, one row / series per run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncengine.bench.groups import SLO, summarize_groups
from asyncengine.bench.records import BenchSummary, RequestRecord


@dataclass(slots=True)
class RunReport:
    """One configuration's run over the shared workload, with the offline hit bounds: with an
    infinite pool (``optimal_hit_rate``), with the run's pool in any order (``pool_hit_rate``)
    and in arrival order (``arrival_hit_rate``); see bench/optimal_hit_finite.py."""

    label: str
    policy: str
    summary: BenchSummary
    records: list[RequestRecord]
    optimal_hit_rate: float
    pool_hit_rate: float = math.nan
    arrival_hit_rate: float = math.nan
    slo: SLO | None = None
    admission_blocked: dict[str, int] | None = None
    # the engine's stats of the run (one replica): recompute tax and swap traffic columns
    engine_stats: dict[str, float] | None = None
    # the output-length predictor's score (core stats "length_predictor": name, kendall_tau)
    length_predictor: dict[str, object] | None = None
    shadow: dict[str, Any] | None = None  # the shadow policy's agreement (ShadowPolicy.stats)
    peak_waiting: int | None = None  # the most requests the waiting queue held (simulated)


SECONDS_PAST = 10.0  # durations from here on read in seconds, shorter ones in milliseconds


def _ms(seconds: float) -> str:
    """A latency with its unit: ms below ``SECONDS_PAST``, seconds from there (a TTFT of
    minutes is not read in milliseconds)."""
    if math.isnan(seconds):
        return "-"
    if seconds < SECONDS_PAST:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _num(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 100:.1f}%"


def _share(value: float, bound: float) -> float:
    return value / bound if bound > 0 else math.nan


TABLE_COLUMNS = (
    "config",
    "policy",
    "done",
    "failed",
    "timed out",
    "req/s",
    "out tok/s",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "ITL p50",
    "ITL p90",
    "ITL p99",
    "TPOT p50",
    "E2E p50",
    "hit rate",
    "bound ∞",
    "hit/∞",
    "bound P",
    "hit/P",
    "bound P, arrival order",
    "hit/P arrival",
    "retracts",
    "recompute tax",
    "swap MB out/in",
    "swap s",
)
SLO_COLUMNS = ("SLO met", "goodput req/s")


def preemption_cells(stats: dict[str, float] | None) -> list[str]:
    """Recompute tax (tokens computed again after a retraction / all computed), bytes swapped
    out and back in (preemption_mode "swap"), and the time the swaps took."""
    if not stats or "recompute_tax" not in stats:
        return ["-", "-", "-"]
    if "swapped_out_bytes" not in stats:
        return [_pct(stats["recompute_tax"]), "-", "-"]
    mb = 1e6
    return [
        _pct(stats["recompute_tax"]),
        f"{stats['swapped_out_bytes'] / mb:.1f}/{stats['swapped_in_bytes'] / mb:.1f}",
        _num(stats["swap_seconds"], 3),
    ]


def table_row(run: RunReport) -> list[str]:
    s = run.summary
    hit = s.cache_hit_rate
    row = [
        run.label,
        f"`{run.policy}`",
        str(s.num_completed),
        str(s.num_failed),
        str(s.num_timed_out),
        _num(s.request_throughput),
        _num(s.output_throughput, 1),
        _ms(s.ttft.p50),
        _ms(s.ttft.p90),
        _ms(s.ttft.p99),
        _ms(s.itl.p50),
        _ms(s.itl.p90),
        _ms(s.itl.p99),
        _ms(s.tpot.p50),
        _ms(s.e2e.p50),
        _pct(hit),
        _pct(run.optimal_hit_rate),
        _pct(_share(hit, run.optimal_hit_rate)),
        _pct(run.pool_hit_rate),
        _pct(_share(hit, run.pool_hit_rate)),
        _pct(run.arrival_hit_rate),
        _pct(_share(hit, run.arrival_hit_rate)),
        str(s.retracts),
        *preemption_cells(run.engine_stats),
    ]
    if run.slo is not None:
        row += [
            _pct(run.slo.attainment(run.records)),
            _num(run.slo.goodput(run.records, s.duration)),
        ]
    return row


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < text_columns else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_table(runs: Sequence[RunReport]) -> str:
    columns = TABLE_COLUMNS + (SLO_COLUMNS if any(run.slo for run in runs) else ())
    rows = [
        table_row(run)
        + (["-", "-"] if len(columns) > len(TABLE_COLUMNS) and run.slo is None else [])
        for run in runs
    ]
    return _markdown(columns, rows, 2)


GROUP_COLUMNS = (
    "config",
    "group",
    "requests",
    "done",
    "timed out",
    "TTFT p50",
    "TTFT p99",
    "TTFT max",
    "E2E p50",
    "steps waited (mean)",
)


def group_table(runs: Sequence[RunReport], by: str) -> str:
    """One row per configuration and tenant (or priority)."""
    rows = []
    for run in runs:
        for g in summarize_groups(run.records, by):
            rows.append([
                run.label, f"{by} {g.group}", str(g.requests), str(g.completed), str(g.timed_out),
                _ms(g.ttft.p50), _ms(g.ttft.p99), _ms(g.ttft.max), _ms(g.e2e.p50), _num(g.queue_steps, 1),
            ])  # fmt: skip
    return _markdown(GROUP_COLUMNS, rows, 2)


def predictor_table(runs: Sequence[RunReport]) -> str:
    """Each run's output-length predictor against the actual lengths of the requests it
    predicted (Kendall's tau-b); runs whose policy asked for no prediction are left out."""
    rows = []
    for run in runs:
        scored = run.length_predictor or {}
        if scored.get("scored"):
            tau = float(scored["kendall_tau"])  # type: ignore[arg-type]
            rows.append([run.label, f"`{scored['name']}`", str(scored["scored"]), _num(tau, 3)])
    if not rows:
        return ""
    return _markdown(("config", "length predictor", "requests scored", "Kendall tau"), rows, 1)


def blocked_table(runs: Sequence[RunReport]) -> str:
    """Why admission stopped: steps counted under each reason, per configuration; and the
    steps that ran nothing because the policy held every waiting request while nothing ran
    (``policy_idle_holds``, with the seconds the engine so sat idle)."""
    reasons = sorted({k for run in runs for k, v in (run.admission_blocked or {}).items() if v})
    idle = [run.engine_stats or {} for run in runs]
    held = any(stats.get("policy_idle_holds") for stats in idle)
    if not reasons and not held:
        return ""
    rows = [
        [run.label, *(str((run.admission_blocked or {}).get(k, 0)) for k in reasons)]
        + (
            [
                str(int(stats.get("policy_idle_holds", 0))),
                _num(float(stats.get("policy_idle_seconds", 0.0))),
            ]
            if held
            else []
        )
        for run, stats in zip(runs, idle, strict=True)
    ]
    header = ("config", *reasons, *(("policy_idle_holds", "policy_idle_seconds") if held else ()))
    return _markdown(header, rows, 1)


def shadow_table(runs: Sequence[RunReport]) -> str:
    """How often each run's shadow policy agreed with the live one (empty without shadows)."""
    rows = []
    for run in runs:
        shadow = run.shadow
        if not shadow:
            continue
        rows.append([
            run.label, f"`{run.policy}`", f"`{shadow['policy']}`", str(shadow["decisions"]),
            _pct(float(shadow["first_pick_agreement"])),
            f"{_pct(float(shadow['top_k_agreement']))} (top {shadow['top_k']})",
        ])  # fmt: skip
    if not rows:
        return ""
    header = ("config", "live", "shadow", "ordering steps", "first pick agrees", "top-k overlap")
    return _markdown(header, rows, 3)


def failure_note(runs: Sequence[RunReport]) -> str:
    """A sentence naming the runs whose policy failed (``policy_failures``): from the first
    failure FCFS ran in its place, so those rows do not measure the policy."""
    failed = [(run.label, int((run.engine_stats or {}).get("policy_failures", 0))) for run in runs]
    named = ", ".join(
        f"`{label}` ({count} failure{'s' * (count != 1)})" for label, count in failed if count
    )
    if not named:
        return ""
    return (
        f"**The policy failed in {named}**: a hook raised, answered what cannot be or stalled "
        "the engine (the log has the error), and FCFS ran the rest of the run in its place (a "
        "failed shadow policy is dropped), so these rows do not measure the policy."
    )


def queue_hint(runs: Sequence[RunReport]) -> str:
    """A sentence when the policies had nothing to reorder: every run's waiting queue held at
    most one request, or every run's latencies and throughput came out identical."""
    peaks = [run.peak_waiting for run in runs if run.peak_waiting is not None]
    if len(runs) < 2 or not peaks:
        return ""

    def key(run: RunReport) -> tuple[float, ...]:
        s = run.summary
        return (s.ttft.p50, s.ttft.p99, s.itl.p50, s.itl.p99, s.output_throughput)

    identical = len({key(run) for run in runs}) == 1
    peak = max(peaks)
    if peak > 1 and not identical:
        return ""
    what = "The rows are identical: the" if identical else "The"
    return (
        f"{what} waiting queue never held more than {peak} request{'s' * (peak != 1)} "
        "(the most seen before any step of any run), so an ordering policy had little or "
        "nothing to reorder; replay at a higher rate (e.g. `--arrivals poisson:RATE` on a "
        "generated workload, or a busier trace) to see the policies differ."
    )


def write_figures(runs: Sequence[RunReport], out_dir: Path) -> list[Path]:
    """TTFT CDF per run, ITL p99 bars, hit rate vs the optimal; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [run.label for run in runs]
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        (run.label, np.sort([r.ttft for r in run.records if r.completed and r.ttft is not None]))
        for run in runs
    ]
    longest = max((float(t[-1]) for _, t in series if t.size), default=0.0)
    unit, scale = ("s", 1.0) if longest >= SECONDS_PAST else ("ms", 1e3)
    for label, ttfts in series:
        if ttfts.size:
            ax.step(
                ttfts * scale,
                np.arange(1, ttfts.size + 1) / ttfts.size,
                where="post",
                label=label,
            )
    ax.set_xlabel(f"TTFT ({unit})")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Time to first token, CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.arange(len(runs))
    p50 = [run.summary.itl.p50 * 1e3 for run in runs]
    p99 = [run.summary.itl.p99 * 1e3 for run in runs]
    ax.bar(x - 0.2, p50, 0.4, label="p50")
    ax.bar(x + 0.2, p99, 0.4, label="p99")
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title("ITL p50 / p99 per configuration")
    ax.legend()
    written.append(_save(fig, out_dir / "itl_p99.png"))

    if not any(run.optimal_hit_rate > 0 for run in runs):
        return written  # nothing is shared: no hit rate to show
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bars = [
        ("achieved", [run.summary.cache_hit_rate for run in runs]),
        ("bound, infinite pool", [run.optimal_hit_rate for run in runs]),
        ("bound, this pool", [run.pool_hit_rate for run in runs]),
        ("bound, this pool in arrival order", [run.arrival_hit_rate for run in runs]),
    ]
    bars = [(name, values) for name, values in bars if not all(map(math.isnan, values))]
    width = 0.8 / len(bars)
    for i, (name, values) in enumerate(bars):
        ax.bar(x - 0.4 + width * (i + 0.5), [v * 100 for v in values], width, label=name)
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_ylabel("prompt tokens from cache (%)")
    # the legend sits above the 100 % line, where no bar reaches, in two columns
    ax.set_ylim(0, 100 + 12 * math.ceil(len(bars) / 2))
    ax.set_yticks(range(0, 101, 20))
    ax.axhline(100, color="0.8", linewidth=0.8)
    ax.set_title("Prefix cache hit rate vs the offline bounds")
    ax.legend(loc="upper center", ncol=2, fontsize=8, frameon=False)
    written.append(_save(fig, out_dir / "hit_rate.png"))
    return written


def write_group_figure(runs: Sequence[RunReport], by: str, out_dir: Path) -> Path:
    """TTFT p50 and p99 of each tenant (or priority) under each configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [summarize_groups(run.records, by) for run in runs]
    groups = sorted({g.group for gs in summaries for g in gs}, key=lambda k: (len(k), k))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=False)
    width = 0.8 / max(len(runs), 1)
    x = np.arange(len(groups))
    longest = max((g.ttft.p99 for gs in summaries for g in gs if g.ttft.count), default=0.0)
    unit, scale = ("s", 1.0) if longest >= SECONDS_PAST else ("ms", 1e3)
    for which, ax in zip(("p50", "p99"), axes, strict=True):
        for i, (run, gs) in enumerate(zip(runs, summaries, strict=True)):
            by_group = {g.group: getattr(g.ttft, which) * scale for g in gs}
            values = [by_group.get(k, math.nan) for k in groups]
            ax.bar(x - 0.4 + width * (i + 0.5), values, width, label=run.label)
        ax.set_xticks(x, [f"{by} {k}" for k in groups], rotation=20, ha="right")
        ax.set_ylabel(f"TTFT {which} ({unit})")
        ax.set_title(f"TTFT {which} by {by}")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    return _save(fig, out_dir / f"ttft_by_{by}.png")


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
