"""Anthropic Messages response bodies: the message, its content blocks, usage, stop reasons,
the streamed events, and the error body.

A stream is ``message_start``, then per content block ``content_block_start``, its deltas
(``thinking_delta``, ``text_delta``, ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (stop reason, usage) and ``message_stop``; every frame is a named SSE event
and no ``[DONE]`` follows. Blocks come from server/output_blocks.py, so a streamed and a
whole message hold the same blocks.

Usage as Anthropic counts it: ``input_tokens`` are the prompt tokens not read from the prefix
cache, ``cache_read_input_tokens`` those that were (their sum is the prompt).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from asyncengine.common.outputs import StreamDelta, Usage
from asyncengine.server.errors import ApiError
from asyncengine.server.output_blocks import Block, BlockEvent, BlockReader
from asyncengine.server.request_ids import current_request_id
from asyncengine.server.sse import NamedEvent
from asyncengine.text.tool_calls import arguments_so_far

Json = dict[str, Any]

# Anthropic's error types by HTTP status
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


# The chat path validates the translated request: its field names, as the client wrote them
_ANTHROPIC_NAMES = (
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"\bstop(?=[\[=])"), "stop_sequences"),
    (re.compile(r"\bresponse_format(?:\.json_schema)?"), "output_config.format"),
)


def anthropic_names(message: str) -> str:
    """``message`` with the chat request's field names put as Anthropic's request has them."""
    for pattern, name in _ANTHROPIC_NAMES:
        message = pattern.sub(name, message)
    return message


def _naming_the_field(message: str, param: str | None) -> str:
    """``message``, led by the field it is about when it does not name it (or the object that
    holds it): Anthropic's shape has no ``param``, and a schema's compile error ("properties
    must be an object") does not say which tool's it is."""
    if param is None:
        return message
    field = anthropic_names(param)
    holder = re.sub(r"(\.\w+|\[\d+\])$", "", field)
    if field in message or holder in message:
        return message
    return f"{field}: {message}"


def error_body(error: ApiError) -> Json:
    """``{"type": "error", "error": {"type", "message"}, "request_id"}``: the id is the one
    the ``request-id`` header carries (server/request_ids.py)."""
    status = error.status
    fallback = "invalid_request_error" if status < 500 else "api_error"
    message = _naming_the_field(anthropic_names(error.message), error.param)
    return {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(status, fallback), "message": message},
        "request_id": current_request_id(),
    }


def error_event(error: ApiError) -> NamedEvent:
    return NamedEvent("error", error_body(error))


def usage_body(usage: Usage) -> Json:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def stop_reason(
    finish_reason: str | None, matched_stop: str | int | None
) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for how the output ended (finish
    reasons Anthropic has no word for, "timeout" and "abort", pass as they are)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop":
        if isinstance(matched_stop, str):
            return "stop_sequence", matched_stop
        return "end_turn", None
    return finish_reason or "end_turn", None


def tool_use_id(call_id: str | None) -> str:
    """The tool parser's call id in Anthropic's spelling."""
    return "toolu_" + (call_id or "").removeprefix("call_")


def content_block(block: Block, whole: bool = True) -> Json:
    """The block's body; ``whole`` false: as a stream starts it (empty)."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if whole else ""}
    return {
        "type": "tool_use",
        "id": tool_use_id(block.call_id),
        "name": block.name,
        # a call cut by max_tokens: the members written whole, as the client reads the stream
        "input": arguments_so_far(block.text) if whole else {},
    }


def message_body(
    message_id: str,
    model: str,
    content: list[Json],
    stop: tuple[str, str | None] | tuple[None, None],
    usage: Json,
) -> Json:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


_DELTA_TYPES = {
    "reasoning": "thinking_delta",
    "text": "text_delta",
    "tool_call": "input_json_delta",
}
_DELTA_FIELDS = {"reasoning": "thinking", "text": "text", "tool_call": "partial_json"}


def _event(name: str, /, **body: Any) -> NamedEvent:
    return NamedEvent(name, {"type": name, **body})


class MessageStream:
    """The ``StreamFormat`` (server/streaming.py) of a streamed message."""

    def __init__(
        self,
        message_id: str,
        model: str,
        prompt_tokens: int,
        reader: BlockReader,
        shown_usage: Callable[[Usage], Usage],
    ) -> None:
        self.shown_usage = shown_usage  # the server's view: cached tokens hidden when asked
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.reader = reader
        self.started = False

    def opening(self) -> list[NamedEvent]:
        return []

    def admitted(self, cached_tokens: int | None) -> list[NamedEvent]:
        """``message_start`` once the request is scheduled, before its prefill ends (its usage
        splits the prompt by the prefix cache, known then); None: with the first delta."""
        if cached_tokens is None:
            return []
        self.started = True
        return [self._start(cached_tokens)]

    def frames(self, delta: StreamDelta) -> list[NamedEvent]:
        start = [] if self.started else [self._start(delta.cached_tokens)]
        self.started = True
        events = self.reader.feed(delta.text, delta.finished)
        return [*start, *(self._frame(event) for event in events)]

    def _start(self, cached_tokens: int) -> NamedEvent:
        usage = usage_body(self.shown_usage(Usage(self.prompt_tokens, 0, cached_tokens)))
        message = message_body(self.message_id, self.model, [], (None, None), usage)
        return _event("message_start", message=message)

    @staticmethod
    def _frame(event: BlockEvent) -> NamedEvent:
        block = event.block
        if event.kind == "start":
            return _event(
                "content_block_start",
                index=block.index,
                content_block=content_block(block, whole=False),
            )
        if event.kind == "stop":
            return _event("content_block_stop", index=block.index)
        piece = {"type": _DELTA_TYPES[block.kind], _DELTA_FIELDS[block.kind]: event.piece}
        return _event("content_block_delta", index=block.index, delta=piece)

    def closing(self, finals: list[StreamDelta]) -> list[NamedEvent]:
        (final,) = finals
        reason, sequence = stop_reason(
            self.reader.finish_reason(final.finish_reason), final.matched_stop
        )
        usage = (
            usage_body(self.shown_usage(final.usage))
            if final.usage is not None
            else {"output_tokens": 0}
        )
        return [
            _event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage=usage,
            ),
            _event("message_stop"),
        ]
