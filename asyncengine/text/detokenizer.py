"""IncrementalDetokenizer: generated token ids -> text deltas, a small window at a time."""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Each step decodes only a small window: the tokens since the last clean boundary before the
    previous delta (the prefix, decoded for context: a sentencepiece tokenizer drops the space
    of a text's first token) plus the new ones, and emits what lies past the text already
    emitted. Text ending in U+FFFD may be an incomplete UTF-8 character whose remaining bytes
    are still to come, so it is held back until a later token completes it; ``flush()`` emits
    whatever is still held when the generation ends.

    Without ``prompt_ids`` the deltas joined (after ``flush()``) equal
    ``tokenizer.decode(all output ids)``. With them, the last prompt tokens are the first
    window's context, so the deltas are what the output adds to the decoded prompt.
    """

    PROMPT_CONTEXT_TOKENS = 5
    _TRIM_AFTER = (
        1024  # drop decoded history past this many tokens (keeps memory per request small)
    )

    def __init__(
        self,
        tokenizer: Decoder,
        skip_special_tokens: bool = True,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT_TOKENS :]) if prompt_ids else []
        self._prefix_offset = 0  # the window to decode starts here in _ids
        self._read_offset = len(self._ids)  # tokens before it were decoded in an earlier window
        # Characters of decode(_ids[_prefix_offset:]) already emitted (or prompt context). A prompt
        # ending in an incomplete character leaves it out: output that completes it emits it.
        self._emitted = len(self._decode(self._ids).rstrip(REPLACEMENT_CHAR))
        self._pieces: list[str] = []
        self._text: str | None = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        window = self._decode(self._ids[self._prefix_offset :])
        stable = len(window.rstrip(REPLACEMENT_CHAR))
        delta = ""
        if stable > self._emitted:
            delta = window[self._emitted : stable]
            self._emitted = stable
            self._append(delta)
        if stable == len(window) and len(self._ids) > self._read_offset:
            # The window ends on a whole character: the tokens just read become the next prefix.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._emitted = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
            if self._prefix_offset > self._TRIM_AFTER:
                del self._ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
        return delta

    def flush(self) -> str:
        """Emit text still held back (an incomplete character at the end of the generation)."""
        window = self._decode(self._ids[self._prefix_offset :])
        delta = window[self._emitted :]
        self._emitted = max(self._emitted, len(window))
        self._append(delta)
        return delta

    def _append(self, delta: str) -> None:
        if delta:
            self._pieces.append(delta)
            self._text = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._pieces)
            self._pieces = [self._text]
        return self._text
