"""Streaming tool-call arguments cost O(n) in all: the scan of a call's arguments keeps its state
between pieces (each character looked at once), for the 100 KB arguments coding agents send,
and the streamed calls equal the whole-text parse."""

from __future__ import annotations

import json
import random

from asyncengine.text.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MAX_HEAD_CHARS,
    MAX_TOOL_NAME_CHARS,
    HermesToolParser,
    collect_calls,
    parse_tool_calls,
    tool_parser,
)


def _big_arguments(size: int) -> str:
    """Arguments JSON of about ``size`` characters, with strings holding brackets, escaped
    quotes and backslashes (what the scanner must not miscount)."""
    rng = random.Random(size)
    lines = [
        f'line {i}: {{"a": [1, 2]}} \\"quoted\\" \\\\ {rng.random()}' for i in range(size // 60)
    ]
    return json.dumps({"path": "src/x.py", "content": "\n".join(lines), "nested": {"k": [[]]}})


def _stream(text: str, piece: int) -> tuple[str, list, HermesToolParser]:
    parser = HermesToolParser()
    emitted, deltas = "", []
    for start in range(0, len(text), piece):
        out = parser.feed(text[start : start + piece])
        emitted += out.text
        deltas += out.calls
    end = parser.finish()
    return emitted + end.text, collect_calls(deltas + end.calls), parser


def test_streamed_100kb_arguments_scan_each_character_once() -> None:
    arguments = _big_arguments(100_000)
    assert len(arguments) > 100_000
    call = json.dumps({"name": "write_file", "arguments": json.loads(arguments)})
    text = f"before <tool_call>\n{call}\n</tool_call> after"
    for piece in (3, 17):
        content, calls, _ = _stream(text, piece)
        whole_content, whole_calls = parse_tool_calls(HERMES, text)
        assert content == whole_content
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole_calls
        ]
        assert json.loads(calls[0].arguments) == json.loads(arguments)
    # the scanner's work: each argument character once, whatever the piece size
    parser = HermesToolParser()
    steps = 0
    for start in range(0, len(text), 4):
        parser.feed(text[start : start + 4])
        call_state = parser._call
        if call_state is not None:
            steps = call_state.arguments_end.steps
    assert len(call) - 60 <= steps <= len(call)  # the arguments, less the call's head


def test_llama3_calls_streamed_in_small_pieces_equal_the_whole_parse() -> None:
    arguments = json.loads(_big_arguments(20_000))
    text = (
        json.dumps({"name": "f", "parameters": arguments})
        + "; "
        + json.dumps({"name": "g", "parameters": {"x": 1}})
    )
    parser = tool_parser(LLAMA3_JSON)
    deltas = []
    for start in range(0, len(text), 5):
        out = parser.feed(text[start : start + 5])
        assert out.text == ""
        deltas += out.calls
    end = parser.finish()
    streamed = collect_calls(deltas + end.calls)
    _, whole = parse_tool_calls(LLAMA3_JSON, text)
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in whole]
    assert [c.name for c in streamed] == ["f", "g"]


def _head_steps(text: str, piece: int) -> tuple[int, HermesToolParser]:
    """The head match's work over ``text`` streamed in ``piece``-character pieces."""
    parser = HermesToolParser()
    steps = 0
    for start in range(0, len(text), piece):
        parser.feed(text[start : start + piece])
        if parser._call is not None:
            steps = parser._call.head_steps
    return steps, parser


def test_a_call_head_is_looked_for_in_bounded_text() -> None:
    """Until a call's name is read its head is matched again on each piece: only over its
    first MAX_HEAD_CHARS characters, so a 100 KB name, or 100 KB of arguments written before
    the name, cost linear work (a name that long is no function's: the block is text; the
    arguments-first call is parsed whole when it closes)."""
    long_name = "f" * 100_000
    text = f'<tool_call>\n{{"name": "{long_name}", "arguments": {{}}}}\n</tool_call>'
    steps, parser = _head_steps(text, 4)
    assert steps <= (MAX_HEAD_CHARS // 4 + 1) * (MAX_HEAD_CHARS + 4)
    piece = parser.finish()
    assert piece.calls == []
    content, calls = parse_tool_calls(HERMES, text)
    assert (content, calls) == (text, [])

    arguments = json.loads(_big_arguments(100_000))
    call = json.dumps({"arguments": arguments, "name": "write_file"})  # name last
    text = f"<tool_call>\n{call}\n</tool_call>"
    steps, _ = _head_steps(text, 4)
    assert steps <= (MAX_HEAD_CHARS // 4 + 1) * (MAX_HEAD_CHARS + 4)
    content, calls, _ = _stream(text, 4)
    assert content == "" and [c.name for c in calls] == ["write_file"]
    assert json.loads(calls[0].arguments) == arguments


def test_names_up_to_the_limit_are_calls() -> None:
    for length, is_call in ((MAX_TOOL_NAME_CHARS, True), (MAX_TOOL_NAME_CHARS + 1, False)):
        name = "g" * length
        text = f'<tool_call>\n{{"name": "{name}", "arguments": {{"x": 1}}}}\n</tool_call>'
        for piece in (1, 7, len(text)):
            content, calls, _ = _stream(text, piece)
            if is_call:
                assert content == "" and [(c.name, c.arguments) for c in calls] == [
                    (name, '{"x": 1}')
                ]
            else:
                assert content == text and calls == []
