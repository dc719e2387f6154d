"""Tool calls in a model's output, parsed incrementally (streaming) or whole (the same parser
fed once), in the two formats the chat templates we know ask for:

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, text allowed
  around the calls (Qwen2.5, Qwen3, Hermes, and our fallback prompt for templates without tools);
- ``llama3_json``: the whole output is ``{"name": "f", "parameters": {...}}`` (Llama 3.1-3.3),
  optionally after ``<|python_tag|>``, several calls separated by ``;``; an object with other
  keys, or without its parameters, is a JSON answer (a response format's), not a call.

A call's ``arguments`` is the model's own JSON text of the arguments object (a JSON string
value is unwrapped). While streaming, a call's id and name go out as soon as the name is read
and its arguments follow as they are generated, the way OpenAI streams ``delta.tool_calls``;
the concatenated argument chunks equal the non-streamed ``arguments``. A block that does not
hold a call (bad JSON, no name, a name longer than ``MAX_TOOL_NAME_CHARS``) is given back as
text. An output that ends inside a call (the length limit met) leaves the parser ``cut``: a call
whose name was read keeps the arguments written so far (JSON cut short, as OpenAI reports such a
call; none when it was cut right after its name), and one cut before its name was written whole
is dropped (its markup is neither text nor a call). The head
(name first) is looked for in a call's first ``MAX_HEAD_CHARS`` characters only, so the work
per piece is bounded; a call written otherwise (arguments first) is parsed whole
when it closes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from asyncengine.text.markers import partial_suffix


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one model family writes a call: ``call_begin + name + name_end`` opens it, the
    arguments object follows, ``call_end`` closes it. ``trigger`` is what starts a call in free
    text; ``separator`` goes between calls."""

    name: str
    call_begin: str
    name_end: str
    call_end: str
    trigger: str
    separator: str

    def opening(self, function: str) -> str:
        return self.call_begin + function + self.name_end


HERMES = ToolCallFormat(
    "hermes",
    call_begin='<tool_call>\n{"name": "',
    name_end='", "arguments": ',
    call_end="}\n</tool_call>",
    trigger="<tool_call>",
    separator="\n",
)
LLAMA3_JSON = ToolCallFormat(
    "llama3_json",
    call_begin='{"name": "',
    name_end='", "parameters": ',
    call_end="}",
    trigger='{"name": ',
    separator="; ",
)

_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# The head of a call written name first: its arguments can stream as they come.
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
# The start of a call cut short once its name was written whole, before its arguments began.
_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
MAX_TOOL_NAME_CHARS = 256  # a longer "name" is no function's (OpenAI allows 64)
MAX_HEAD_CHARS = 2 * MAX_TOOL_NAME_CHARS  # a head's name, keys, spacing and escapes fit


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed piece of call ``index``: its id and name first, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def body(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, "arguments": self.arguments}
        body: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            body["id"] = self.id
            body["type"] = "function"
        body["function"] = function
        return body


@dataclass(slots=True)
class ParsedPiece:
    """What one ``feed`` or ``finish`` gives: text for ``content`` and call pieces."""

    text: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class JsonValueEnd:
    """Finds where a JSON object or array ends, fed in pieces: the scan's state (depth, inside
    a string, after a backslash) carries over, so each character is looked at once.
    ``steps`` counts the characters looked at."""

    __slots__ = ("depth", "in_string", "escaped", "done", "steps")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self.steps = 0

    def feed(self, text: str, start: int = 0) -> int | None:
        """Index in ``text`` just past the value's closing bracket; None while not closed."""
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        end: int | None = None
        i = start
        for i in range(start, len(text)):
            char = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    end = i + 1
                    break
        self.steps += (i + 1 - start) if end is not None else len(text) - start
        self.depth, self.in_string, self.escaped = depth, in_string, escaped
        self.done = end is not None
        return end


def _json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array starting at ``text[start]``; None while it
    is not closed yet."""
    return JsonValueEnd().feed(text, start)


def _head_name(head: re.Match[str]) -> str | None:
    """The function name a call's head spells (JSON string escapes undone)."""
    try:
        name = json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None
    return name if _is_name(name) else None


def _is_name(name: object) -> bool:
    return isinstance(name, str) and 0 < len(name) <= MAX_TOOL_NAME_CHARS


def parse_call_body(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one call's JSON, or None when it is not a call."""
    head = _CALL_HEAD.match(body)
    if head is not None and body[head.end() : head.end() + 1] == "{":
        end = _json_value_end(body, head.end())
        name = _head_name(head)
        if end is not None and name is not None:
            return name, body[head.end() : end]
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not _is_name(value.get("name")):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _cut_call(text: str, position: int = 0) -> tuple[str, str] | None:
    """(name, arguments written so far) of a call cut short at the end of ``text``; None when
    it was cut before its name was written whole."""
    head = _CALL_HEAD.match(text, position)
    if head is not None and text[head.end() : head.end() + 1] == "{":
        name = _head_name(head)
        return None if name is None else (name, text[head.end() :])
    named = _NAME_HEAD.match(text, position)
    name = _head_name(named) if named is not None else None
    return None if name is None else (name, "")


class _StreamedCall:
    """One call while its text arrives: the head once the name is known, then the arguments
    object as it grows (held back past its closing brace)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.head = ""  # the call's text until its arguments begin, while the head may come
        self.rest: list[str] = []  # the text after it, once no head can come
        self.args_start: int | None = None  # where the arguments object starts in head
        self.arguments_end = JsonValueEnd()  # the arguments' scan, kept between pieces
        self.head_steps = 0  # characters the head's match was tried on, in all
        self.named_only = False  # cut after its name, before its arguments began

    @property
    def body(self) -> str:
        """The call's text until its arguments begin (all of it when they never did)."""
        return self.head + "".join(self.rest)

    def grow(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if self.args_start is None:
            if len(self.head) > MAX_HEAD_CHARS:  # no head in its first characters
                self.rest.append(text)
                return deltas
            if not text:
                return deltas
            self.head += text
            self.head_steps += len(self.head)
            head = _CALL_HEAD.match(self.head)
            if head is None or len(self.head) <= head.end() or self.head[head.end()] != "{":
                return deltas
            name = _head_name(head)
            if name is None:
                return deltas
            self.args_start = head.end()
            deltas.append(ToolCallDelta(self.index, self.id, name))
            text = self.head[self.args_start :]
        if self.arguments_end.done:  # text past the arguments' closing brace is held back
            return deltas
        end = self.arguments_end.feed(text)
        new = text if end is None else text[:end]
        if new:
            deltas.append(ToolCallDelta(self.index, arguments=new))
        return deltas

    @property
    def in_string(self) -> bool:
        """Whether the text so far ends inside a string of the arguments."""
        return self.args_start is not None and self.arguments_end.in_string

    @property
    def cut(self) -> bool:
        """Whether the call was cut: after its name, or inside its arguments."""
        return self.named_only or (self.args_start is not None and not self.arguments_end.done)

    def close(self, closed: bool) -> list[ToolCallDelta] | None:
        """The rest of the call once its text ends (``closed``: by its end marker, else cut
        short); None when the body holds no call (then nothing was sent)."""
        if self.args_start is not None:
            return []
        parsed = parse_call_body(self.body)
        if parsed is None and not closed:
            parsed = _cut_call(self.body)
            self.named_only = parsed is not None
        if parsed is None:
            return None
        name, arguments = parsed
        return [ToolCallDelta(self.index, self.id, name, arguments)]


class HermesToolParser:
    """``<tool_call>{...}</tool_call>`` blocks inside free text."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet classified (may begin a marker)
        self._call: _StreamedCall | None = None
        self.count = 0  # calls found so far
        self.cut = False  # the output ended inside a call

    def feed(self, text: str) -> ParsedPiece:
        piece = ParsedPiece()
        self._pending += text
        while self._pending:
            if self._call is None:
                at = self._pending.find(_HERMES_OPEN)
                if at < 0:
                    keep = partial_suffix(self._pending, _HERMES_OPEN)
                    piece.text += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                piece.text += self._pending[:at]
                self._pending = self._pending[at + len(_HERMES_OPEN) :]
                self._call = _StreamedCall(self.count)
            else:
                at = self._pending.find(_HERMES_CLOSE)
                if at < 0:
                    keep = partial_suffix(self._pending, _HERMES_CLOSE)
                    piece.calls += self._call.grow(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                piece.calls += self._call.grow(self._pending[:at])
                self._pending = self._pending[at + len(_HERMES_CLOSE) :]
                if self._call.in_string:  # a string value's text (the grammar lets it be)
                    piece.calls += self._call.grow(_HERMES_CLOSE)
                    continue
                self._close(piece, closed=True)
        return piece

    def _close(self, piece: ParsedPiece, closed: bool) -> None:
        assert self._call is not None
        rest = self._call.close(closed)
        if rest is None and closed:  # not a call: give the block back as text
            piece.text += _HERMES_OPEN + self._call.body + _HERMES_CLOSE
        elif rest is None:  # cut before its name: nothing of it was sent
            self.cut = True
        else:
            piece.calls += rest
            self.count += 1
            self.cut = not closed and self._call.cut
        self._call = None

    def finish(self) -> ParsedPiece:
        piece = ParsedPiece()
        if self._call is not None:
            self._call.grow(self._pending)
            self._pending = ""
            self._close(piece, closed=False)
        piece.text += self._pending
        self._pending = ""
        return piece


class Llama3JsonToolParser:
    """An output that is only calls, ``{"name": ..., "parameters": ...}`` separated by ``;``
    (after an optional ``<|python_tag|>``); any other output is text. Calls are known only when
    the output ends, so they are sent whole then."""

    def __init__(self) -> None:
        self._buffer = ""  # the output until it is known to be calls or text
        self._calls: list[str] = []  # an output of calls, in pieces (joined once, at the end)
        self._calls_mode: bool | None = None  # None until the first non-space character
        self.count = 0
        self.cut = False  # the output ended inside a call

    def feed(self, text: str) -> ParsedPiece:
        if self._calls_mode:
            self._calls.append(text)
            return ParsedPiece()
        self._buffer += text
        if self._calls_mode is None:
            head = self._buffer.lstrip()
            if not head:
                return ParsedPiece()
            if _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]) and len(head) < len(_PYTHON_TAG):
                return ParsedPiece()  # maybe the tag, cut
            self._calls_mode = head.startswith(("{", _PYTHON_TAG))
        if self._calls_mode:
            self._calls.append(self._buffer)
            self._buffer = ""
            return ParsedPiece()
        text, self._buffer = self._buffer, ""
        return ParsedPiece(text)

    def finish(self) -> ParsedPiece:
        text = self._buffer + "".join(self._calls)
        self._buffer, self._calls = "", []
        if not self._calls_mode:
            return ParsedPiece(text)
        split = _split_llama_calls(text.strip().removeprefix(_PYTHON_TAG))
        if split is None:
            return ParsedPiece(text)
        calls, self.cut = split
        deltas = [
            ToolCallDelta(index, new_call_id(), name, arguments)
            for index, (name, arguments) in enumerate(calls)
        ]
        self.count = len(deltas)
        return ParsedPiece("", deltas)


def _split_llama_calls(text: str) -> tuple[list[tuple[str, str]], bool] | None:
    """The calls (name, arguments) and whether the last was cut (its arguments so far; one
    cut before its name was written whole is left out); None when the text is not calls."""
    calls: list[tuple[str, str]] = []
    decoder = json.JSONDecoder()
    position = 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
        if position == len(text):
            return (calls, False) if calls else None
        if text[position] != "{":
            return None
        end = _json_value_end(text, position)
        if end is None:
            if not _may_be_call(text, position):
                return None
            cut = _cut_call(text, position)
            if cut is not None:
                calls.append(cut)
            return calls, True
        try:
            value = decoder.decode(text[position:end])
        except ValueError:
            return None
        if not _is_llama_call(value):
            return None
        parsed = parse_call_body(text[position:end])
        if parsed is None:
            return None
        calls.append(parsed)
        position = end


# A Llama 3 call is {"name": ..., "parameters": {...}} ("arguments" too; Llama 3.2 may lead with
# "type"): an answer that merely has a "name" key (a response format's, say) stays text.
_LLAMA_CALL_KEYS = frozenset({"type", "name", "parameters", "arguments"})
_ARGUMENT_KEYS = ('"parameters"', '"arguments"')


def _is_llama_call(value: object) -> bool:
    return (
        isinstance(value, dict)
        and value.keys() <= _LLAMA_CALL_KEYS
        and ("parameters" in value or "arguments" in value)
    )


def _may_be_call(text: str, position: int) -> bool:
    """Whether a Llama 3 output cut at its end may still be a call: not when its name is
    followed by another key than the arguments'."""
    named = _NAME_HEAD.match(text, position)
    if named is None:
        return True
    rest = text[named.end() :].lstrip()
    if not rest:
        return True
    if rest[0] != ",":
        return False
    key = rest[1:].lstrip()
    return any(k.startswith(key[: len(k)]) for k in _ARGUMENT_KEYS)


ToolParser = HermesToolParser | Llama3JsonToolParser


def tool_parser(fmt: ToolCallFormat) -> ToolParser:
    return HermesToolParser() if fmt is HERMES else Llama3JsonToolParser()


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """``deltas`` with adjacent pieces of one call joined: a chunk carries one entry per call
    index, as OpenAI's do (the id and name, if any, then all its argument text)."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.index == delta.index and delta.id is None:
            last.arguments += delta.arguments
            if last.name is None:
                last.name = delta.name
        else:
            merged.append(ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments))
    return merged


def collect_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls that a sequence of deltas describes, in index order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            call = calls[delta.index] = ToolCall(delta.id or new_call_id(), delta.name or "", "")
        call.arguments += delta.arguments
    return [calls[index] for index in sorted(calls)]


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's text (calls removed) and calls."""
    parser = tool_parser(fmt)
    first, last = parser.feed(text), parser.finish()
    return first.text + last.text, collect_calls(first.calls + last.calls)


class _Unread(Exception):
    """No value can be read at this place of a cut JSON text."""


_DECODER = json.JSONDecoder()
_BLANKS = " \t\r\n"


def arguments_so_far(arguments: str) -> dict[str, Any]:
    """The object a call's arguments describe as far as they were written: the members whose
    values are whole, inside open objects and arrays too; a string, literal or key cut short is
    left out (what Anthropic's client reads from a stream of ``partial_json`` pieces)."""
    try:
        value, _, _ = _value_so_far(arguments, _skip_blanks(arguments, 0))
    except _Unread:
        return {}
    return value if isinstance(value, dict) else {}


def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i] in _BLANKS:
        i += 1
    return i


def _value_so_far(text: str, i: int) -> tuple[Any, int, bool]:
    """The value at ``text[i]``, where it ends, and whether it is whole."""
    if i >= len(text):
        raise _Unread
    if text[i] in "{[":
        return _container_so_far(text, i)
    try:
        value, end = _DECODER.raw_decode(text, i)
    except ValueError:
        raise _Unread from None
    if end < len(text) and text[end] not in _BLANKS + ",]}":  # a number that goes on
        raise _Unread
    return value, end, True


def _container_so_far(text: str, i: int) -> tuple[Any, int, bool]:
    is_object = text[i] == "{"
    close = "}" if is_object else "]"
    members: dict[str, Any] = {}
    items: list[Any] = []
    i = _skip_blanks(text, i + 1)
    while i < len(text) and text[i] != close:
        key = ""
        if is_object:
            if text[i] != '"':
                break
            try:
                key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            except ValueError:
                break
            i = _skip_blanks(text, i)
            if text[i : i + 1] != ":":
                break
            i = _skip_blanks(text, i + 1)
        try:
            value, i, whole = _value_so_far(text, i)
        except _Unread:
            break
        if is_object:
            members[key] = value
        else:
            items.append(value)
        i = _skip_blanks(text, i)
        if not whole or text[i : i + 1] != ",":
            break
        i = _skip_blanks(text, i + 1)
    found = members if is_object else items
    if text[i : i + 1] == close:
        return found, i + 1, True
    return found, len(text), False
