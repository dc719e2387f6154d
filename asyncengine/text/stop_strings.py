"""Stop strings over streamed text: find a match, and hold back what could still become one.

A stop string may arrive split over several deltas ("<|" then "end|>"), so the tail of the
text that is the beginning of some stop string is not emitted until the next delta decides it.
Text after a match is never emitted, and the stop string itself is not part of the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StopScan:
    """``emit``: text safe to send now. ``matched``: the stop string found, if any (the output
    ends before it). ``held``: trailing characters of the scanned text kept back because they
    could be the beginning of a stop string (0 when one matched)."""

    emit: str
    matched: str | None
    held: int


def scan_stop_strings(text: str, stop: Sequence[str]) -> StopScan:
    """Split ``text`` (not yet emitted) into what to emit, a match, and a held-back tail.

    The match that ends first wins (the one a token-by-token scan meets first, so the result
    does not depend on how the text was split into deltas); of those ending at the same place,
    the longest.
    """
    best_end = -1
    matched: str | None = None
    for candidate in stop:
        index = text.find(candidate)
        if index == -1:
            continue
        end = index + len(candidate)
        if matched is None or end < best_end or (end == best_end and len(candidate) > len(matched)):
            best_end, matched = end, candidate
    if matched is not None:
        return StopScan(text[: best_end - len(matched)], matched, 0)
    held = 0
    for candidate in stop:
        for length in range(min(len(candidate) - 1, len(text)), held, -1):
            if text.endswith(candidate[:length]):
                held = length
                break
    return StopScan(text[: len(text) - held], None, held)


@dataclass(slots=True)
class StopStringFilter:
    """Feed detokenized deltas; get back the text to stream and the stop string once one matches.

    Only the held-back tail is rescanned with each delta, so a step costs O(delta + longest stop).
    """

    stop: list[str]
    pending: str = field(default="", init=False)
    matched: str | None = field(default=None, init=False)

    def push(self, delta: str) -> StopScan:
        if self.matched is not None:
            return StopScan("", self.matched, 0)
        if not self.stop:
            return StopScan(delta, None, 0)
        scan = scan_stop_strings(self.pending + delta, self.stop)
        self.matched = scan.matched
        self.pending = (self.pending + delta)[len(scan.emit) :] if scan.matched is None else ""
        return scan

    def flush(self) -> str:
        """The held-back tail, once the generation ended for another reason (length, EOS)."""
        tail, self.pending = self.pending, ""
        return "" if self.matched is not None else tail
