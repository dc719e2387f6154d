"""OutputText: a request's output detokenized as its tokens land, with its stop strings.

It lives on the request (``Request.text``) so that the lifecycle, on the core side, ends the
request in the step whose token completes a stop string; the stream reads the text it cleared.
"""

from __future__ import annotations

from typing import Any

from asyncengine.text.stop_strings import StopStringFilter


class OutputText:
    def __init__(self, detokenizer: Any, stop: list[str], keep_stop: bool = False) -> None:
        self.detokenizer = detokenizer
        self.stops = StopStringFilter(stop, keep_stop)
        self.ready = ""  # text cleared for the caller, not yet taken

    def push(self, token_id: int, may_stop: bool = True) -> str | None:
        """Take one sampled token; return the stop string it completed, if any (none while
        ``may_stop`` is False: before the request's minimum tokens)."""
        scan = self.stops.push(self.detokenizer.add([token_id]), may_stop)
        self.ready += scan.emit
        return scan.matched

    def take(self) -> str:
        """The text cleared since the last call (none that could still become a stop string)."""
        text, self.ready = self.ready, ""
        return text

    def finish(self) -> str:
        """The rest of the text once the request has ended: what was held back for a stop
        string or an incomplete character, unless a stop string ended it."""
        if self.stops.matched is None:
            flush = getattr(self.detokenizer, "flush", None)
            if flush is not None:  # bytes held back for an incomplete character
                self.ready += self.stops.push(flush()).emit
            self.ready += self.stops.flush()
        return self.take()
