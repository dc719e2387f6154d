"""One table of eviction rules against Belady's bound on the same pool.

Belady's bound is ``optimal_hit_finite(..., order="arrival")``: the most prompt tokens any
eviction can serve from a pool of the run's size when the requests run one at a time in arrival
order. A rule's hit tokens are the engine's (a concurrent run holds more pages for live
requests, so a rule can only come near the bound, and tokens shared within one step or taken
from a kept tail page count as hits too, which the bound's model does not have)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class EvictionRow:
    label: str
    base: str  # the run less its rule: a rule's gain is over the lru row of the same base
    rule: str  # the rule's name
    hit_tokens: int
    bound_tokens: int  # Belady's, in arrival order, same pool
    hit_rate: float
    ttft_p50_s: float
    output_tok_s: float
    evictions: int
    recomputed_tokens: int  # computed again after an eviction had dropped them

    @property
    def of_bound(self) -> float:
        return self.hit_tokens / self.bound_tokens if self.bound_tokens else float("nan")


def eviction_table(rows: Sequence[EvictionRow]) -> str:
    """Markdown: each rule's hit tokens, their share of Belady's bound, and their gain over
    the ``lru`` row of the same base (when there is one)."""
    lrus = {row.base: row for row in rows if row.rule == "lru"}
    lines = [
        "| run | rule | hit tokens | Belady (arrival order) | % of Belady | vs lru | hit rate "
        "| TTFT p50 ms | out tok/s | evictions | re-computed tokens |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lru = lrus.get(row.base)
        gain = (
            f"{row.hit_tokens / lru.hit_tokens - 1:+.1%}"
            if lru is not None and lru.hit_tokens
            else "-"
        )
        # no prefix any eviction could serve (nothing shared, or a pool too small): no share
        of_bound = f"{row.of_bound:.1%}" if row.bound_tokens else "-"
        lines.append(
            f"| {row.label} | {row.rule} | {row.hit_tokens} | {row.bound_tokens} | "
            f"{of_bound} | {gain} | {row.hit_rate:.3f} | {row.ttft_p50_s * 1e3:.1f} | "
            f"{row.output_tok_s:.1f} | {row.evictions} | {row.recomputed_tokens} |"
        )
    return "\n".join(lines)
