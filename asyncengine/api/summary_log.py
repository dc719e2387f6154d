"""The engine's periodic one-line summary: load, token rates, cache hits and KV use since the
last line, and nothing at all while nothing changes (an idle server stays quiet).

    prefilling=0 running=3 waiting=0 http_requests=5 gen_tok/s=41.0 prompt_tok/s=120.3
    cache_hit=37.5% kv_pages used=12 cached=30 total=2048

``prompt_tok/s`` is the prompt tokens the forwards computed over the interval (a long prompt's
chunks as they run, not its whole length when it is admitted); ``cache_hit`` is the share of
the prompts admitted over the interval found in the prefix cache. ``AsyncEngine`` runs it every
``config.log_interval`` seconds; a front end adds its own cumulative counters to the line (the
HTTP server adds ``http_requests``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# cumulative engine counters the line turns into rates or counts over the interval
_COUNTERS = (
    "generated_tokens",
    "prefill_computed_tokens",
    "hit_tokens",
    "miss_tokens",
    "retractions",
)
# instantaneous values; a line is due when one of them differs from the last line's
_GAUGES = ("prefilling", "running", "waiting", "pages_used", "pages_cached")
# the gauges that say work is in flight
_BUSY = ("prefilling", "running", "waiting")


@dataclass(slots=True)
class _Snapshot:
    time: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    total_pages: int = 0


class SummaryLog:
    """Builds summary lines from consecutive ``stats()`` snapshots."""

    def __init__(
        self, stats: Callable[[], dict[str, Any]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stats = stats
        self._clock = clock
        self._extra: dict[str, Callable[[], float]] = {}
        self._last: _Snapshot | None = None
        self._last_logged_gauges: dict[str, float] | None = None

    def add_counter(self, name: str, read: Callable[[], float]) -> None:
        """Show ``name=<increase since the last line>`` after the queue lengths."""
        self._extra[name] = read
        if self._last is not None:
            self._last.counters[name] = float(read())

    async def run(self, interval: float, log: logging.Logger) -> None:
        """Log a line every ``interval`` seconds, skipping those that would repeat the last."""
        while True:
            await asyncio.sleep(interval)
            line = self.line()
            if line is not None:
                log.info("%s", line)

    def reset(self) -> None:
        """Start counting from now (the engine calls it when it starts)."""
        self._last = self._snapshot()
        self._last_logged_gauges = self._last.gauges

    def line(self) -> str | None:
        """The summary since the previous call, or None when nothing changed in between."""
        now = self._snapshot()
        last = self._last
        if last is None:
            last = _Snapshot(now.time, dict.fromkeys(now.counters, 0.0))
        moved = {k: v - last.counters.get(k, 0.0) for k, v in now.counters.items()}
        if not any(moved.values()) and now.gauges == self._last_logged_gauges:
            # A step longer than the interval moves nothing until it ends: its time stays in
            # the next line's rates. Idle time belongs to no rate.
            if not any(now.gauges[k] for k in _BUSY):
                self._last = now
            return None
        self._last = now
        self._last_logged_gauges = now.gauges
        dt = max(now.time - last.time, 1e-9)
        hit, miss = moved["hit_tokens"], moved["miss_tokens"]
        prefilled = moved["prefill_computed_tokens"]
        g = {k: int(v) for k, v in now.gauges.items()}
        parts = [f"prefilling={g['prefilling']} running={g['running']} waiting={g['waiting']}"]
        parts += [f"{name}={int(moved[name])}" for name in self._extra]
        parts.append(
            f"gen_tok/s={moved['generated_tokens'] / dt:.1f} prompt_tok/s={prefilled / dt:.1f} "
            f"cache_hit={(hit / (hit + miss) if hit + miss else 0.0):.1%} "
            f"kv_pages used={g['pages_used']} cached={g['pages_cached']} total={now.total_pages}"
        )
        if moved["retractions"]:
            parts.append(f"retractions={int(moved['retractions'])}")
        return " ".join(parts)

    def _snapshot(self) -> _Snapshot:
        stats = self._stats()
        snap = _Snapshot(self._clock())
        for key in _COUNTERS:
            snap.counters[key] = float(stats.get(key, 0))
        for name, read in self._extra.items():
            snap.counters[name] = float(read())
        snap.gauges = {key: float(stats.get(key, 0)) for key in _GAUGES}
        snap.total_pages = int(stats.get("pages_total", 0))
        return snap
