"""Aho-Corasick over a request's stop strings: each new character of output costs O(1)
amortized, however much text is held back and however long the stop strings are.

A state is the longest suffix of the text seen so far that is a prefix of some stop string,
so its depth is exactly the text to hold back, and the stop string that ends at a character
(the longest one, when several end there) is read off the state in one lookup.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache

_CHAR_BITS = 21  # Unicode code points are below 2**21: a (state, character) pair is one int key

# Automata of small stop sets are shared between requests (chat templates repeat theirs); the
# key bounds what the cache can hold.
_CACHED_CHARS = 512


class StopAutomaton:
    """The immutable automaton of one stop set; a cursor (a state number) walks it."""

    __slots__ = ("_goto", "_fail", "_ends", "depth")

    def __init__(self, stops: Sequence[str]) -> None:
        goto: dict[int, int] = {}
        depth = [0]
        ends: list[str | None] = [None]
        children: list[list[tuple[int, int]]] = [[]]
        for stop in stops:
            node = 0
            for char in stop:
                code = ord(char)
                key = node << _CHAR_BITS | code
                child = goto.get(key)
                if child is None:
                    child = len(depth)
                    goto[key] = child
                    depth.append(depth[node] + 1)
                    ends.append(None)
                    children.append([])
                    children[node].append((code, child))
                node = child
            ends[node] = stop
        fail = [0] * len(depth)
        queue = deque(child for _, child in children[0])
        while queue:  # breadth first: a node's failure link is shallower, so already done
            node = queue.popleft()
            for code, child in children[node]:
                queue.append(child)
                state = fail[node]
                while True:
                    target = goto.get(state << _CHAR_BITS | code)
                    if target is not None:
                        fail[child] = target
                        break
                    if state == 0:
                        break
                    state = fail[state]
                if ends[child] is None:  # the longest stop string that is a suffix of this node
                    ends[child] = ends[fail[child]]
        self._goto = goto
        self._fail = fail
        self._ends = ends
        self.depth = depth

    def advance(self, state: int, text: str, start: int = 0) -> tuple[int, int, str | None, int]:
        """Walk ``text[start:]`` from ``state`` until a stop string ends.

        Returns the state reached, the characters of ``text`` consumed (up to and including the
        match's last one; ``start`` included), the stop string matched (None: none, all
        consumed), and the transitions taken (each failure link and each character: the work
        done). Walking on from the returned state and index finds the matches after it.
        """
        goto = self._goto
        fail = self._fail
        ends = self._ends
        steps = 0
        for index in range(start, len(text)):
            code = ord(text[index])
            while True:
                steps += 1
                target = goto.get(state << _CHAR_BITS | code)
                if target is not None:
                    state = target
                    break
                if state == 0:
                    break
                state = fail[state]
            matched = ends[state]
            if matched is not None:
                return state, index + 1, matched, steps
        return state, len(text), None, steps


@lru_cache(maxsize=256)
def _cached(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


def stop_automaton(stops: Sequence[str]) -> StopAutomaton:
    """The automaton of ``stops``; small sets are built once and shared."""
    key = tuple(stops)
    if sum(len(stop) for stop in key) <= _CACHED_CHARS:
        return _cached(key)
    return StopAutomaton(key)
