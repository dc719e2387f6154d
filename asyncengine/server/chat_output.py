"""A chat choice's text read back as OpenAI's message: ``reasoning_content`` (the think
block), ``content`` (the answer, None when the choice only called tools) and ``tool_calls``;
``finish_reason`` "tool_calls" when it called any and stopped on its own with every call whole
(the legacy ``functions``: the call as ``function_call``, and "function_call"). A call cut by
the length limit stays with the arguments written so far, and the finish reason stays
"length", as OpenAI's API reports it.

The same reader serves both tails: ``ChoiceReader.feed`` turns each streamed text delta into
the ``delta`` of a chunk (None: nothing to send yet), the last one with ``final`` flushing
what was held back; a whole output is one final read, so streamed and non-streamed answers
agree: the SDK's accumulation of the deltas is the whole message (``content`` null until
answer text comes, blanks held until text follows them, "" at the end when nothing came).
"""

from __future__ import annotations

from typing import Any

from asyncengine.server.chat_tools import ChatOutputSpec
from asyncengine.text.reasoning import ReasoningParser
from asyncengine.text.text_pieces import joined
from asyncengine.text.tool_calls import ToolCallDelta, collect_calls, merge_deltas, tool_parser

Json = dict[str, Any]


class ChoiceReader:
    def __init__(self, spec: ChatOutputSpec) -> None:
        self._reasoning = (
            ReasoningParser(spec.reasoning_starts_inside)
            if spec.reasoning_starts_inside is not None
            else None
        )
        self._tools = tool_parser(spec.tool_format) if spec.tool_format is not None else None
        self._calls_only = spec.calls_only
        self._legacy = spec.legacy_functions
        self._include_reasoning = spec.include_reasoning
        self.called = False  # any tool call so far
        self._reasoning_pieces: list[str] = []  # joined when read (text_pieces)
        self._answered = False  # answer text sent (streaming)
        self._blanks = ""  # blank answer text held back until text follows it

    @property
    def reasoning(self) -> str:
        """The reasoning read so far."""
        return joined(self._reasoning_pieces)

    @property
    def cut(self) -> bool:
        """Whether the output ended inside a tool call."""
        return self._tools is not None and self._tools.cut

    def read(self, text: str, final: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """The reasoning, answer text and call pieces that ``text`` completes (``final``: the
        output ended after it)."""
        reasoning, content = "", text
        if self._reasoning is not None:
            piece = self._reasoning.feed(text)
            if final:
                rest = self._reasoning.finish()
                piece.reasoning += rest.reasoning
                piece.content += rest.content
            reasoning, content = piece.reasoning, piece.content
            self._reasoning_pieces.append(reasoning)
        if self._tools is None:
            return reasoning, content, []
        answer = self._tools.feed(content)
        if final:
            rest_answer = self._tools.finish()
            answer.text += rest_answer.text
            answer.calls += rest_answer.calls
        if answer.calls:
            self.called = True
        return reasoning, "" if self._calls_only else answer.text, answer.calls

    def feed(self, text: str, final: bool = False) -> Json | None:
        """The ``delta`` of a chunk for ``text`` (None: nothing to send yet)."""
        reasoning, content, calls = self.read(text, final)
        delta: Json = {}
        if reasoning and self._include_reasoning:
            delta["reasoning_content"] = reasoning
        answer = self._answer(content, final)
        if answer is not None:
            delta["content"] = answer
        if calls:
            delta.setdefault("content", None)  # as OpenAI's call deltas have it
        if calls and self._legacy:  # one call: its name first, then its arguments' pieces
            delta["function_call"] = merge_deltas(calls)[0].body()["function"]
        elif calls:
            delta["tool_calls"] = [call.body() for call in merge_deltas(calls)]
        return delta or None

    def _answer(self, text: str, final: bool) -> str | None:
        """The answer text to send now: blanks wait for text after them (the whole message has
        no content when blanks only stand around its calls); at the end of an output without
        calls, whatever is held ("" when nothing came)."""
        if self._answered:
            return text or None
        self._blanks += text
        if not self._blanks.strip() and not (final and not self.called):
            return None
        self._answered = True
        held, self._blanks = self._blanks, ""
        return held

    def finish_reason(self, reason: str | None) -> str | None:
        if self.called and reason == "stop" and not self.cut:
            return "function_call" if self._legacy else "tool_calls"
        return reason


def read_choice(
    spec: ChatOutputSpec, text: str, finish_reason: str | None
) -> tuple[Json, str | None]:
    """The message of a whole choice, and its finish reason (the reasoning kept in it whatever
    ``spec.include_reasoning``: the caller counts it, then leaves it out)."""
    reader = ChoiceReader(spec)
    reasoning, content, pieces = reader.read(text, final=True)
    calls = collect_calls(pieces)
    message: Json = {"role": "assistant", "content": content}
    if calls:
        message["content"] = content if content.strip() else None
        if spec.legacy_functions:
            message["function_call"] = calls[0].body()["function"]
        else:
            message["tool_calls"] = [call.body() for call in calls]
    if spec.reasoning_starts_inside is not None:
        message["reasoning_content"] = reasoning or None
    return message, reader.finish_reason(finish_reason)


def reasoning_tokens(tokenizer: Any, reasoning: str) -> int:
    """The tokens of a choice's reasoning (its think block's text, the tags left out), as the
    usage's ``reasoning_tokens`` counts them in both OpenAI APIs."""
    return len(tokenizer.encode(reasoning)) if reasoning else 0
