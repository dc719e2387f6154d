"""A chat choice's output as the ordered blocks that Anthropic's Messages and OpenAI's Responses
answer with: reasoning, text, and one block per tool call.

The text is read by ``ChoiceReader`` (server/chat_output.py), the reader Chat Completions uses,
so reasoning, answer and calls are split the same way on every API; this module only cuts the
result into blocks. Each streamed delta gives block events (a block starts, grows, stops; one
block is open at a time), and a whole output is one final feed, so the blocks of a streamed
and a non-streamed answer agree. A block of reasoning or text opens at its first non-blank
piece (the blanks before it go with it), so the blanks around tool calls make no block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from asyncengine.server.chat_output import ChoiceReader
from asyncengine.server.chat_tools import ChatOutputSpec
from asyncengine.text.text_pieces import joined

BlockKind = Literal["reasoning", "text", "tool_call"]
PLAIN_TEXT = ChatOutputSpec(tool_format=None, reasoning_starts_inside=None)


@dataclass(slots=True)
class Block:
    """``text``: the reasoning or answer text, or a call's arguments (JSON text) so far."""

    kind: BlockKind
    index: int  # its position among the choice's blocks
    call_id: str | None = None
    name: str | None = None
    pieces: list[str] = field(default_factory=list)  # its text, joined when read (text_pieces)

    @property
    def text(self) -> str:
        return joined(self.pieces)


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """``piece``: the text a "delta" adds to ``block``."""

    kind: Literal["start", "delta", "stop"]
    block: Block
    piece: str = ""


class BlockReader:
    def __init__(self, spec: ChatOutputSpec | None) -> None:
        self._reader = ChoiceReader(spec or PLAIN_TEXT)
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # by the parser's call index
        self._blanks: dict[BlockKind, str] = {}  # blank text before a block opens

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str, final: bool = False) -> list[BlockEvent]:
        """The block events ``text`` completes (``final``: the output ended after it)."""
        reasoning, content, calls = self._reader.read(text, final)
        events: list[BlockEvent] = []
        self._text("reasoning", reasoning, events)
        # the reader gives a piece's text and calls apart: text read while a call is open
        # comes after that call's end, text read otherwise before the next call's start
        in_call = self._open is not None and self._open.kind == "tool_call"
        if not in_call:
            self._text("text", content, events)
        for call in calls:
            block = self._calls.get(call.index)
            if block is None:
                block = Block("tool_call", len(self.blocks), call_id=call.id, name=call.name)
                self._calls[call.index] = block
                self._start(block, events)
            if call.arguments:
                self._grow(block, call.arguments, events)
        if in_call:
            self._text("text", content, events)
        if final and self._open is not None:
            events.append(BlockEvent("stop", self._open))
            self._open = None
        return events

    def finish_reason(self, reason: str | None) -> str | None:
        """ "tool_calls" for an output that called and stopped on its own."""
        return self._reader.finish_reason(reason)

    def _text(self, kind: BlockKind, piece: str, events: list[BlockEvent]) -> None:
        if not piece:
            return
        if self._open is not None and self._open.kind == kind:
            self._grow(self._open, piece, events)
            return
        pending = self._blanks.get(kind, "") + piece
        if not pending.strip():
            self._blanks[kind] = pending
            return
        block = Block(kind, len(self.blocks))
        self._start(block, events)
        self._grow(block, pending, events)

    def _start(self, block: Block, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("stop", self._open))
        self._blanks.clear()
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("start", block))

    @staticmethod
    def _grow(block: Block, piece: str, events: list[BlockEvent]) -> None:
        block.pieces.append(piece)
        events.append(BlockEvent("delta", block, piece))


def read_blocks(spec: ChatOutputSpec | None, text: str) -> BlockReader:
    """A whole output read (``reader.blocks``, ``reader.finish_reason``), fed in pieces that
    each start at a ``<`` (where the think and call markers start), so that no piece holds
    text on both sides of a call."""
    reader = BlockReader(spec)
    pieces = _BEFORE_MARKER.split(text)
    for piece in pieces[:-1]:
        reader.feed(piece)
    reader.feed(pieces[-1], final=True)
    return reader


_BEFORE_MARKER = re.compile(r"(?=<)")
