"""Embedding requests: a prompt pooled into one unit vector, prefill only (nothing sampled).

An embedding request goes through the scheduler like any other (policies order it, the radix
cache shares its pages, prefill is chunked) but needs no decode slot: it ends when its last
prompt chunk lands. The executor answers each of its chunks (``Segment.pool``) with the float32
sum of the chunk's final hidden states ("sum", mean pooling) or the last position's hidden
state ("last", on the last chunk only); ``PooledEmbedding`` gathers those parts across chunks
and gives the normalized vector.

Mean pooling needs every position's hidden state, and the prefix cache keeps only K and V, so a
mean-pooled request takes nothing from the cache (it still leaves its pages there for others);
a last-token one starts after its cached prefix like a generation does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SUM = "sum"  # Segment.pool: the sum of the segment's rows
LAST = "last"  # Segment.pool: the segment's last row


@dataclass(slots=True)
class PooledEmbedding:
    """One embedding request's pooling, and its parts so far."""

    pooling: str  # "mean" | "last"
    total: list[float] | None = None  # sum of the rows pooled so far (mean) or the last row
    rows: int = 0
    vector: list[float] = field(default_factory=list)  # the result, once complete

    @property
    def reuses_prefix(self) -> bool:
        """Whether its cached prefix can be skipped (only the last position is pooled)."""
        return self.pooling == "last"

    def segment_pool(self, final: bool) -> str | None:
        """What the executor returns for a chunk of this request (None: nothing)."""
        if self.pooling == "mean":
            return SUM
        return LAST if final else None

    def add(self, part: list[float], rows: int) -> None:
        """Take a chunk's part: its rows' sum (mean pooling) or its last row."""
        if self.pooling == "last" or self.total is None:
            self.total = list(part)
        else:
            self.total = [a + b for a, b in zip(self.total, part, strict=True)]
        self.rows += rows

    def finish(self) -> list[float]:
        """The pooled vector, L2-normalized (``vector``)."""
        if self.total is None:
            raise RuntimeError("no hidden state was pooled")
        scale = 1.0 / self.rows if self.pooling == "mean" else 1.0
        mean = [x * scale for x in self.total]
        norm = math.sqrt(math.fsum(x * x for x in mean))
        self.vector = [x / norm for x in mean] if norm > 0 else mean
        return self.vector
