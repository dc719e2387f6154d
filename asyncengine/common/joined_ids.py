"""A request's tokens (prompt, then output) read in place: the per-step readers (n-gram lookup,
the draft model's catch-up, a prefill chunk) each take a few tokens of a context that may hold
100k, so they index and slice the two lists rather than concatenate them every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload


class JoinedIds(Sequence[int]):
    """``prompt + output`` as of its making, without the copy: indexing costs O(1), a slice
    O(its length). Later appends to ``output`` are not in it (its length is fixed)."""

    __slots__ = ("_prompt", "_output", "_split", "_len")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt = prompt
        self._output = output
        self._split = len(prompt)
        self._len = self._split + len(output)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self._span(start, stop)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("JoinedIds index out of range")
        split = self._split
        return self._prompt[index] if index < split else self._output[index - split]

    def _span(self, start: int, stop: int) -> list[int]:
        """Tokens ``start`` up to ``stop`` (bounds already within the length) in one list."""
        if stop <= start:
            return []
        split = self._split
        if stop <= split:
            return self._prompt[start:stop]
        if start >= split:
            return self._output[start - split : stop - split]
        return [*self._prompt[start:], *self._output[: stop - split]]
