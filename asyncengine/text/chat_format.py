"""What a model's chat template can do with tools and reasoning, and the conversation as that
template wants it.

- A template that takes ``tools`` and writes ``<tool_call>`` (Qwen2.5, Qwen3, Hermes) renders
  the tools itself; its model answers in the ``hermes`` format.
- A template that takes ``tools`` and writes ``"parameters"`` JSON calls (Llama 3.1-3.3)
  renders them itself; its model answers in the ``llama3_json`` format.
- Any other template (the embedded SmolLM2's ChatML among them) gets the tools in a system
  prompt (``FALLBACK_TOOL_PROMPT``) that asks for the ``hermes`` format; earlier calls and tool
  results in the conversation are written as that prompt describes them (an assistant turn
  with ``<tool_call>`` blocks, a user turn with ``<tool_response>`` blocks).

Templates that render tools get the messages the way Hugging Face templates read them: an
assistant's ``tool_calls`` with ``function.arguments`` as an object, tool results as
``{"role": "tool", "content", "tool_call_id"}``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateSyntaxError, meta

from asyncengine.text.reasoning import template_reasons
from asyncengine.text.tokenizer import _chat_environment
from asyncengine.text.tool_calls import HERMES, LLAMA3_JSON, ToolCallFormat

FALLBACK_TOOL_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions are given as \
JSON signatures inside <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, write a JSON object with the function's name and arguments inside \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-object>}}
</tool_call>
The result of each call comes back inside <tool_response></tool_response> tags."""


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """``renders_tools``: the template writes the tools itself (else the fallback prompt);
    ``tool_format``: how its model writes calls; ``reasons``: it writes think blocks."""

    renders_tools: bool
    tool_format: ToolCallFormat
    reasons: bool


@functools.lru_cache(maxsize=16)
def chat_format(template: str | None) -> ChatFormat:
    reasons = template_reasons(template)
    if template is None or "tools" not in _template_variables(template):
        return ChatFormat(False, HERMES, reasons)
    if "<tool_call>" in template:
        return ChatFormat(True, HERMES, reasons)
    if '"parameters"' in template and ("<|python_tag|>" in template or "ipython" in template):
        return ChatFormat(True, LLAMA3_JSON, reasons)
    return ChatFormat(False, HERMES, reasons)  # a tool format we do not parse


def _template_variables(template: str) -> frozenset[str]:
    try:
        parsed = _chat_environment().parse(template)
    except TemplateSyntaxError:
        return frozenset()
    return frozenset(meta.find_undeclared_variables(parsed))


def _arguments_object(arguments: str) -> Any:
    """A call's arguments as templates read them: the object, or the text when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


@dataclass(slots=True)
class ChatTurn:
    """One message: text content, and for an assistant its calls (id, name, arguments JSON
    text), for a tool result the call it answers."""

    role: str
    content: str
    tool_calls: list[tuple[str, str, str]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def template_messages(
    turns: list[ChatTurn], fmt: ChatFormat, tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` variable to render ``turns`` with (tools None: the
    template is not given any)."""
    if fmt.renders_tools:
        return [_native_message(turn) for turn in turns], tools or None
    messages = _fallback_messages(turns)
    if tools:
        prompt = FALLBACK_TOOL_PROMPT.format(
            tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        )
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def _native_message(turn: ChatTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _arguments_object(arguments)},
            }
            for call_id, name, arguments in turn.tool_calls
        ]
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    if turn.name is not None:
        message["name"] = turn.name
    return message


def _fallback_messages(turns: list[ChatTurn]) -> list[dict[str, Any]]:
    """The turns as the fallback prompt describes them; the results of consecutive tool calls
    share one user turn, so templates that require user and assistant turns to alternate
    (Gemma's) take a parallel call's results."""
    messages: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        message = _fallback_message(turn)
        if turn.role == "tool" and index > 0 and turns[index - 1].role == "tool":
            messages[-1]["content"] += "\n" + message["content"]
        else:
            messages.append(message)
    return messages


def _fallback_message(turn: ChatTurn) -> dict[str, Any]:
    if turn.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{turn.content}\n</tool_response>"}
    if turn.tool_calls:
        calls = "\n".join(_call_text(name, arguments) for _, name, arguments in turn.tool_calls)
        content = f"{turn.content}\n{calls}" if turn.content else calls
        return {"role": turn.role, "content": content}
    return {"role": turn.role, "content": turn.content}
