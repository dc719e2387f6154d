"""Stop strings over streamed text: find a match, and hold back what could still become one.

A stop string may arrive split over several deltas ("<|" then "end|>"), so the tail of the
text that is the beginning of some stop string is not emitted until the next delta decides it.
Text after a match is never emitted, and the stop string itself is not part of the output
(unless ``keep_matched``: vLLM's include_stop_str_in_output, SGLang's no_stop_trim).
The match that ends first wins (the one a token-by-token scan meets first, so the result does
not depend on how the text was split into deltas); of those ending at the same place, the
longest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncengine.text.stop_automaton import StopAutomaton, stop_automaton


@dataclass(frozen=True, slots=True)
class StopScan:
    """``emit``: text safe to send now. ``matched``: the stop string found, if any (the output
    ends before it). ``held``: trailing characters of the scanned text kept back because they
    could be the beginning of a stop string (0 when one matched)."""

    emit: str
    matched: str | None
    held: int


def scan_stop_strings(text: str, stop: Sequence[str]) -> StopScan:
    """Split ``text`` (not yet emitted) into what to emit, a match, and a held-back tail."""
    if not stop:
        return StopScan(text, None, 0)
    automaton = stop_automaton(stop)
    state, consumed, matched, _ = automaton.advance(0, text)
    if matched is not None:
        return StopScan(text[: consumed - len(matched)], matched, 0)
    held = automaton.depth[state]
    return StopScan(text[: len(text) - held], None, held)


@dataclass(slots=True)
class StopStringFilter:
    """Feed detokenized deltas; get back the text to stream and the stop string once one matches.

    The automaton's state carries over between deltas and the held text is a queue of chunks,
    so a delta costs O(delta) amortized and never more than O(delta + longest stop string).
    ``steps`` counts the automaton's transitions (the matching work done so far).
    """

    stop: list[str]
    keep_matched: bool = False  # the output ends with the stop string matched, not before it
    matched: str | None = field(default=None, init=False)
    steps: int = field(default=0, init=False)
    _automaton: StopAutomaton | None = field(default=None, init=False)
    _state: int = field(default=0, init=False)
    _held: deque[str] = field(default_factory=deque, init=False)
    _held_length: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.stop:
            self._automaton = stop_automaton(self.stop)

    @property
    def pending(self) -> str:
        """The text held back (a suffix of the output that begins some stop string)."""
        return "".join(self._held)

    def push(self, delta: str, may_stop: bool = True) -> StopScan:
        """``may_stop`` False: a stop string ending in this delta does not count (the request
        has not produced its minimum tokens yet); one ending in a later delta does."""
        if self.matched is not None:
            return StopScan("", self.matched, 0)
        automaton = self._automaton
        if automaton is None:
            return StopScan(delta, None, 0)
        state, consumed, matched, steps = automaton.advance(self._state, delta)
        self.steps += steps
        while matched is not None and not may_stop:
            state, consumed, matched, steps = automaton.advance(state, delta, consumed)
            self.steps += steps
        if matched is not None:
            self.matched = matched
            self._append(delta[:consumed])
            kept = self._held_length if self.keep_matched else self._held_length - len(matched)
            emit = self._take_front(kept)
            self._held.clear()
            self._held_length = 0
            return StopScan(emit, matched, 0)
        self._state = state
        self._append(delta)
        held = automaton.depth[state]
        return StopScan(self._take_front(self._held_length - held), None, held)

    def flush(self) -> str:
        """The held-back tail, once the generation ended for another reason (length, EOS)."""
        tail = self.pending
        self._held.clear()
        self._held_length = 0
        self._state = 0
        return "" if self.matched is not None else tail

    def _append(self, text: str) -> None:
        if text:
            self._held.append(text)
            self._held_length += len(text)

    def _take_front(self, count: int) -> str:
        """Remove and return the first ``count`` held characters."""
        if count <= 0:
            return ""
        self._held_length -= count
        parts: list[str] = []
        while count:
            chunk = self._held.popleft()
            if len(chunk) > count:
                parts.append(chunk[:count])
                self._held.appendleft(chunk[count:])
                break
            parts.append(chunk)
            count -= len(chunk)
        return "".join(parts)
