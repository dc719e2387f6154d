"""IncrementalDetokenizer: generated token ids -> text deltas, a small window at a time."""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Sequence
from typing import Protocol, overload

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer(Protocol):
    def add(self, token_ids: list[int]) -> str: ...


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
    # A UTF-8 character is at most 4 bytes and a token at least one: text still ending in
    # U+FFFD after more tokens than that is not an incomplete character (_settle).
    _CHARACTER_TOKENS = 4
    _MAX_HELD_TOKENS = 2 * _CHARACTER_TOKENS
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
            self._move(self._read_offset, len(self._ids))
            self._emitted = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        elif len(self._ids) - self._read_offset > self._MAX_HELD_TOKENS:
            delta += self._settle(window)
        return delta

    def _settle(self, window: str) -> str:
        """Emit the U+FFFD that ``_CHARACTER_TOKENS`` later tokens did not complete (invalid
        bytes, or a token that is U+FFFD) and move the window past them: an output that keeps
        ending in U+FFFD would otherwise decode a window as long as itself at every step. Left
        as it is where the last tokens change how the ones before them decode."""
        cut = len(self._ids) - self._CHARACTER_TOKENS
        head = self._decode(self._ids[self._prefix_offset : cut])
        start = max(self._prefix_offset, cut - self.PROMPT_CONTEXT_TOKENS)
        context = self._decode(self._ids[start:cut])
        tail = window[len(head) :]
        if not window.startswith(head) or self._decode(self._ids[start:]) != context + tail:
            return ""
        delta = window[self._emitted : len(head)]
        self._append(delta)
        self._emitted = len(context) + max(self._emitted - len(head), 0)
        self._move(start, cut)
        return delta

    def _move(self, prefix_offset: int, read_offset: int) -> None:
        self._prefix_offset, self._read_offset = prefix_offset, read_offset
        if self._prefix_offset > self._TRIM_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

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


class ByteLevelDetokenizer:
    """``IncrementalDetokenizer``'s contract for byte-level BPE tokenizers (GPT-2's scheme:
    SmolLM2, Llama 3, Qwen), at one table lookup per token instead of two tokenizer decodes.

    Their decoder maps every token to a fixed byte string and decodes the bytes joined, with
    U+FFFD for invalid UTF-8 (``token_bytes``: that string per id, b"" for a token the decode
    skips; ``TokenBytes``). So the text so far is the bytes so far through
    an incremental UTF-8 decoder, which holds back an incomplete character until a later token
    completes it (``flush()`` emits it as U+FFFD when the generation ends there). Prompt
    context: the last prompt tokens go through the decoder first, unseen, so an output that
    completes a character the prompt began emits that character.
    """

    def __init__(self, token_bytes: Sequence[bytes], prompt_ids: list[int] | None = None) -> None:
        self._table = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        if prompt_ids:
            self._decoder.decode(
                self._bytes(prompt_ids[-IncrementalDetokenizer.PROMPT_CONTEXT_TOKENS :])
            )
        self._pieces: list[str] = []
        self._text: str | None = ""

    def _bytes(self, token_ids: list[int]) -> bytes:
        table, size = self._table, len(self._table)
        return b"".join(table[t] if 0 <= t < size else b"" for t in token_ids)

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; return the text they complete (possibly empty)."""
        if len(token_ids) == 1 and 0 <= token_ids[0] < len(self._table):
            delta = self._decoder.decode(self._table[token_ids[0]])
        else:
            delta = self._decoder.decode(self._bytes(token_ids))
        if delta:
            self._pieces.append(delta)
            self._text = None
        return delta

    def flush(self) -> str:
        """Emit bytes still held back (an incomplete character at the end of the generation)."""
        delta = self._decoder.decode(b"", final=True)
        if delta:
            self._pieces.append(delta)
            self._text = None
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._pieces)
            self._pieces = [self._text]
        return self._text


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = {byte: byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {chr(char): byte for byte, char in chars.items()}


_ALPHABET = _gpt2_byte_decoder()
_LETTERS = frozenset(_ALPHABET)
_TO_LATIN1 = str.maketrans({char: chr(byte) for char, byte in _ALPHABET.items()})


def byte_level_bytes(token: str) -> bytes:
    """A token's bytes as a byte-level decoder turns it: its characters through GPT-2's
    alphabet, or (a character outside it, as in most added tokens) the token's own UTF-8."""
    if _LETTERS.issuperset(token):  # each character one byte: latin-1 writes it as such
        return token.translate(_TO_LATIN1).encode("latin-1")
    return token.encode("utf-8")


_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


def piece_bytes(token: str) -> bytes:
    """A sentencepiece-style token's bytes: a byte-fallback token (``<0xF0>``) the byte it names,
    any other its UTF-8 with the word marker ``\u2581`` read as the space it stands for."""
    byte = _BYTE_PIECE.fullmatch(token)
    if byte is not None:
        return bytes((int(byte.group(1), 16),))
    return token.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")


class TokenBytes(Sequence[bytes]):
    """Each id's bytes (``byte_level_bytes`` of its token), worked out when the id is first
    looked up: b"" for the ``skipped`` ids (special tokens, when the decode skips them) and ids
    without a token. A vocabulary of ~150k tokens took ~0.2 s to turn whole, which a server's
    first request paid; a request looks up a few hundred."""

    def __init__(
        self, token_of: Callable[[int], str | None], size: int, skipped: frozenset[int]
    ) -> None:
        self._token_of = token_of
        self._skipped = skipped
        self._known: list[bytes | None] = [None] * size

    def __len__(self) -> int:
        return len(self._known)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        known = self._known[index]
        if known is None:  # two threads may both work it out: the same bytes
            token = None if index in self._skipped else self._token_of(index % len(self))
            known = self._known[index] = b"" if token is None else byte_level_bytes(token)
        return known


class TextOffsets:
    """OpenAI's legacy ``text_offset``: where each of a choice's tokens starts in its text, in
    characters. A token's offset is ``start`` plus what the incremental decode of the tokens
    before it emitted, so a token holding part of a character moves no offset until a later one
    completes it. Tokens go in order, a delta's at a time, through the one ``detokenizer``."""

    def __init__(self, detokenizer: Detokenizer, start: int = 0) -> None:
        self._detokenizer = detokenizer
        self._at = start

    def of(self, token_ids: list[int], end: int) -> list[int]:
        """The offsets of ``token_ids``, none past ``end``: the length of the text returned so
        far, which a stop string may have cut short of what the tokens decode to."""
        offsets: list[int] = []
        for token_id in token_ids:
            offsets.append(min(self._at, end))
            self._at += len(self._detokenizer.add([token_id]))
        return offsets
