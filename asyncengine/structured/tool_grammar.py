"""The grammar a tool choice decodes under, as an xgrammar structural tag.

- ``required``: the output is one or more calls (``parallel`` false: exactly one), each of a
  listed function with arguments valid under its ``parameters`` schema, and nothing else (but
  the separator after the last);
- a named function: exactly one call of it;
- ``auto``: free text in which a call, once its trigger (``<tool_call>``, or ``{"name": `` for
  Llama 3) is written, must complete as a valid call of a listed function; with an ``answer``
  schema (a response format beside the tools), either a JSON text valid under it or calls as
  under ``required``.

A model that reasons (``<think>`` templates) may write its think block first under
``required`` and a named function (it must, when the prompt left it inside the block).
Arguments are written compactly (at most one blank between tokens), so a weak model cannot
pad a call with endless whitespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncengine.common.sampling_params import StructuredOutput
from asyncengine.structured.schema_annotations import grammar_schema
from asyncengine.text.reasoning import THINK_CLOSE, THINK_OPEN
from asyncengine.text.tool_calls import ToolCallFormat

ARGUMENT_WHITESPACE = 1  # consecutive whitespace characters allowed inside arguments


@dataclass(frozen=True, slots=True)
class ToolFunction:
    name: str
    parameters: dict[str, Any] | bool  # True: any JSON object


def arguments_schema(function: ToolFunction) -> dict[str, Any] | bool:
    """The schema a call's arguments are held to."""
    # descriptions bound nothing; a pattern the grammar cannot read is left out of a tool
    # only described (a held tool's schema was refused for it: server/chat_tools.py)
    schema = grammar_schema(function.parameters, readable_patterns_only=True)
    return {"type": "object"} if schema is True else schema


def _call_tag(fmt: ToolCallFormat, function: ToolFunction) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": fmt.opening(function.name),
        "content": {
            "type": "json_schema",
            "json_schema": arguments_schema(function),
            "max_whitespace_cnt": ARGUMENT_WHITESPACE,
        },
        "end": fmt.call_end,
    }


def _think_block(starts_inside: bool) -> dict[str, Any]:
    block: dict[str, Any] = {
        "type": "tag",
        "begin": "" if starts_inside else THINK_OPEN,
        "content": {"type": "any_text"},
        "end": THINK_CLOSE,
    }
    spaced = {"type": "sequence", "elements": [block, {"type": "regex", "pattern": r"\s{0,2}"}]}
    return spaced if starts_inside else {"type": "optional", "content": spaced}


def tool_call_grammar(
    fmt: ToolCallFormat,
    functions: list[ToolFunction],
    mode: str,
    parallel: bool = True,
    reasoning: bool = False,
    starts_inside_thinking: bool = False,
    answer: dict[str, Any] | bool | None = None,
) -> StructuredOutput:
    """``mode``: "auto", "required" or "named" (``functions`` then holds the one function);
    ``answer``: under "auto", the JSON schema a text answer is held to."""
    tags = [_call_tag(fmt, function) for function in functions]
    if mode == "auto" and answer is not None:
        text = {
            "type": "json_schema",
            "json_schema": answer_schema(answer),
            "max_whitespace_cnt": ARGUMENT_WHITESPACE,
        }
        calls = _calls(fmt, tags, parallel)
        body: dict[str, Any] = {"type": "or", "elements": [text, calls]}
    elif mode == "auto":
        body = {
            "type": "triggered_tags",
            "triggers": [fmt.trigger],
            "tags": tags,
            "stop_after_first": not parallel,
        }
    elif mode in ("named", "required"):
        body = _calls(fmt, tags, parallel and mode == "required")
    else:
        raise ValueError(f"unknown tool grammar mode {mode!r}")
    if reasoning and (mode != "auto" or answer is not None):
        body = {"type": "sequence", "elements": [_think_block(starts_inside_thinking), body]}
    # keys in their given order: a schema's properties are generated in the order listed
    return StructuredOutput(
        "structural_tag", json.dumps({"type": "structural_tag", "format": body})
    )


def answer_schema(answer: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """The schema a text answer beside the tools is held to."""
    return grammar_schema(answer)


def _calls(fmt: ToolCallFormat, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """One call of the tags (``parallel`` false), or one or more."""
    if not parallel:
        return tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.separator,
        "at_least_one": True,
    }
    # the separator may also close the output: a model that ends its last call with it (a
    # Hermes newline before its end of turn) is not held to write one more call
    trailing = {"type": "optional", "content": {"type": "const_string", "value": fmt.separator}}
    return {"type": "sequence", "elements": [calls, trailing]}
