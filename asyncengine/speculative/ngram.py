"""Prompt lookup: guesses copied from the request's own tokens (prompt and output so far).

The guess after a sequence is what followed the most recent earlier occurrence of its last n
tokens, for the longest n in ``[min_n, max_n]`` that occurred before. An index per n maps each
n-gram to the end of its latest occurrence; it is filled incrementally as tokens land, so a step
costs a few dictionary look-ups per request, not a scan of its context.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """One request's n-gram index. ``tokens`` passed to ``propose`` only ever grow (a request's
    prompt then output; a request that ends takes its proposer with it)."""

    __slots__ = ("min_n", "max_n", "_latest", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # _latest[n - min_n][gram] = end (exclusive) of the latest indexed occurrence of gram
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed = 0  # n-grams ending at every end <= _indexed are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``tokens`` (``max_n`` down to ``min_n`` tokens long); [] when none occurred. A match
        close to the end continues into the guesses themselves (a repeating pattern repeats)."""
        length = len(tokens)
        # Only n-grams with a continuation are indexed: those ending at length - 1 or before.
        # The suffix itself (ending at length) goes in at the next call, once a token follows it.
        for end in range(self._indexed + 1, length):
            for n, latest in enumerate(self._latest, self.min_n):
                if end >= n:
                    latest[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, length - 1)
        if k <= 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if length < n:
                continue
            found = self._latest[n - self.min_n].get(tuple(tokens[length - n :]))
            if found is not None:
                return _continuation(tokens, found, k)
        return []


def _continuation(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on; past the end of ``tokens`` the copy reads what
    it has already copied (as LZ77 copies overlap), so a period of p tokens repeats."""
    length = len(tokens)
    out: list[int] = []
    for i in range(start, start + k):
        out.append(tokens[i] if i < length else out[i - length])
    return out
