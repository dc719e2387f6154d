"""Text that grows by pieces (a stream's deltas), kept as a list and joined when read:
appending to one string copies the text so far at every delta, work that grows with the square
of the output."""

from __future__ import annotations


def joined(pieces: list[str]) -> str:
    """The pieces' text; ``pieces`` becomes that one piece, so a later read joins only what
    came after it."""
    if len(pieces) > 1:
        pieces[:] = ["".join(pieces)]
    return pieces[0] if pieces else ""
