"""Markers (``<tool_call>``, ``</think>``) in streamed text: a marker may arrive cut over two
deltas, so the end of the text that could begin one is held back until the next delta."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
