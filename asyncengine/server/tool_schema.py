"""The tool-calling parts of a chat completion request (OpenAI's shapes), as msgspec Structs.

They are decoded with the request, so a malformed tool is a 400 naming the field, and they
appear in /openapi.json like every other body type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from asyncengine.server.errors import ApiError, invalid_request

# OpenAI asks for [a-zA-Z0-9_-]{1,64}; dots and colons are let through too (MCP tool names use
# them). The name is written into the call grammar and the prompt, so nothing else is allowed.
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class FunctionDefinition(Struct, kw_only=True, omit_defaults=True):
    """As the client wrote it: fields it left out stay out of the tools the template renders
    (``"strict": null`` cost prompt tokens HF's rendering has not)."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(Struct, kw_only=True):
    name: FunctionName


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI); an object is taken too


class AssistantToolCall(Struct, kw_only=True):
    """A call an earlier assistant turn made, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


def answers_no_call(param: str, call_id: str, where: str) -> ApiError:
    """The 400 for a tool result whose call id names no call it may answer (``where``: the
    calls it was looked for among), as OpenAI's and Anthropic's APIs refuse it."""
    return invalid_request(f"{param} {call_id!r} answers no call: {where}", param=param)
