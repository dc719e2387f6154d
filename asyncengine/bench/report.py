"""Comparison reports: a markdown table and matplotlib figures, one row / series per run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asyncengine.bench.records import BenchSummary, RequestRecord


@dataclass(slots=True)
class RunReport:
    """One configuration's run over the shared workload."""

    label: str
    policy: str
    summary: BenchSummary
    records: list[RequestRecord]
    optimal_hit_rate: float


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _num(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 100:.1f}%"


TABLE_COLUMNS = (
    "config",
    "policy",
    "done",
    "failed",
    "req/s",
    "out tok/s",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p90 ms",
    "ITL p99 ms",
    "TPOT p50 ms",
    "E2E p50 ms",
    "hit rate",
    "optimal",
    "hit/optimal",
    "retracts",
)


def table_row(run: RunReport) -> list[str]:
    s = run.summary
    ratio = s.cache_hit_rate / run.optimal_hit_rate if run.optimal_hit_rate > 0 else math.nan
    return [
        run.label,
        f"`{run.policy}`",
        str(s.num_completed),
        str(s.num_failed),
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
        _pct(s.cache_hit_rate),
        _pct(run.optimal_hit_rate),
        _pct(ratio),
        str(s.retracts),
    ]


def markdown_table(runs: Sequence[RunReport]) -> str:
    lines = [
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(TABLE_COLUMNS))) + "|",
    ]
    lines += ["| " + " | ".join(table_row(run)) + " |" for run in runs]
    return "\n".join(lines) + "\n"


def write_figures(runs: Sequence[RunReport], out_dir: Path) -> list[Path]:
    """TTFT CDF per run, ITL p99 bars, hit rate vs the optimal; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [run.label for run in runs]
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ttfts = np.sort([r.ttft for r in run.records if r.completed and r.ttft is not None])
        if ttfts.size:
            ax.step(
                ttfts * 1e3,
                np.arange(1, ttfts.size + 1) / ttfts.size,
                where="post",
                label=run.label,
            )
    ax.set_xlabel("TTFT (ms)")
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

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(x - 0.2, [run.summary.cache_hit_rate * 100 for run in runs], 0.4, label="achieved")
    ax.bar(x + 0.2, [run.optimal_hit_rate * 100 for run in runs], 0.4, label="optimal (offline)")
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_ylabel("prompt tokens from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Prefix cache hit rate vs optimal")
    ax.legend(loc="lower right")
    written.append(_save(fig, out_dir / "hit_rate.png"))
    return written


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
