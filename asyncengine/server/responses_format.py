"""OpenAI Responses bodies: the response object, its output items (``reasoning``, ``message``
with ``output_text``, ``function_call``), usage, and the streamed ``response.*`` events.

A stream is ``response.created`` and ``response.in_progress``; per output item
``response.output_item.added``, for a message or reasoning ``response.content_part.added``, the
deltas (``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``) and their ``.done``, ``response.content_part.done``,
``response.output_item.done``; then ``response.completed`` (``response.incomplete`` when the
output was cut short) with the whole response. Every event is a named SSE event with a
``sequence_number``; no ``[DONE]`` follows. Items come from server/output_blocks.py, so a
streamed and a whole response hold the same items.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from asyncengine.common.outputs import StreamDelta, Usage
from asyncengine.server.errors import ApiError
from asyncengine.server.output_blocks import Block, BlockEvent, BlockReader
from asyncengine.server.responses_schema import (
    InputItem,
    OutputText,
    ReasoningText,
    ResponsesRequest,
)
from asyncengine.server.sse import NamedEvent

Json = dict[str, Any]

_ID_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def status_of(finish_reason: str | None) -> tuple[str, Json | None]:
    """The response's status and ``incomplete_details`` for how its output ended."""
    if finish_reason in (None, "stop", "tool_calls"):
        return "completed", None
    reason = "max_output_tokens" if finish_reason == "length" else finish_reason
    return "incomplete", {"reason": reason}


def usage_body(usage: Usage, reasoning_tokens: int) -> Json:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)
        },
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _part(block: Block, text: str) -> Json:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_item(block: Block, item_id: str, status: str, whole: bool = True) -> Json:
    """The item of one block; ``whole`` false: as a stream adds it (empty)."""
    if block.kind == "tool_call":
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": block.call_id,
            "name": block.name,
            "arguments": block.text if whole else "",
            "status": status,
        }
    parts = [_part(block, block.text)] if whole else []
    if block.kind == "reasoning":
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": parts,
            "status": status,
        }
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": parts,
    }


def as_input_item(item: Json) -> InputItem:
    """An output item as the input item that stands for it in a later turn."""
    if item["type"] == "function_call":
        return InputItem(
            type="function_call",
            call_id=item["call_id"],
            name=item["name"],
            arguments=item["arguments"],
        )
    if item["type"] == "reasoning":
        return InputItem(
            type="reasoning", content=[ReasoningText(text=p["text"]) for p in item["content"]]
        )
    return InputItem(
        role="assistant", content=[OutputText(text=p["text"]) for p in item["content"]]
    )


# input items without an id of their own get one when stored, by type (as OpenAI's)
_INPUT_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
    "item_reference": "ref",
}


def with_ids(items: list[InputItem]) -> list[InputItem]:
    """The items, each with an id (its own, else a new one): the ids that page their list."""
    return [item if item.id is not None else _with_new_id(item) for item in items]


def _with_new_id(item: InputItem) -> InputItem:
    return msgspec.structs.replace(item, id=f"{_INPUT_ID_PREFIXES[item.type]}_{uuid.uuid4().hex}")


def listed_item(item: InputItem) -> Json:
    """An input item as ``GET /v1/responses/{id}/input_items`` lists it, in OpenAI's shape: a
    message's content as parts (a string as one ``input_text``, or ``output_text`` for the
    assistant's), every item with its ``type`` and a ``status``."""
    body: Json = {
        "type": item.type,
        **msgspec.to_builtins(item),
        "status": item.status or "completed",
    }
    if item.type == "message":
        content = item.content
        if isinstance(content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            body["content"] = [{"type": kind, "text": content}]
        for part in body.get("content") or []:
            if part["type"] == "output_text":
                part.setdefault("annotations", [])
    elif item.type == "reasoning":
        body.setdefault("summary", [])
    return body


def items_page(
    items: list[Json], limit: int, descending: bool, after: str | None, before: str | None
) -> Json:
    """One page of ``items`` (oldest first) as OpenAI's list object: ``limit`` items in the
    order asked for, after the item ``after`` or ending just before the item ``before`` (ids
    in that order); 400 for an id not among them."""
    ordered = items[::-1] if descending else items
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    if after is not None:
        start = _position(ids, after, "after") + 1
    if before is not None:
        end = _position(ids, before, "before")
    if before is not None and after is None:
        start = max(start, end - limit)  # the items closest to the cursor
        has_more = start > 0
    else:
        has_more = end - start > limit
    data = ordered[start:end][:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _position(ids: list[str], item_id: str, param: str) -> int:
    try:
        return ids.index(item_id)
    except ValueError:
        raise ApiError(
            400, f"{param}: no input item of this response has the id {item_id!r}", param=param
        ) from None


class ResponseBody:
    """The response objects of one request (one id, one creation time, the request's echo)."""

    def __init__(self, response_id: str, model: str, req: ResponsesRequest, stored: bool) -> None:
        self.id = response_id
        self.created_at = int(time.time())
        self.item_ids: dict[int, str] = {}  # by block index
        tools = [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": t.strict is not False,  # strict unless turned off (OpenAI's)
            }
            for t in req.tools or []
        ]
        choice = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        self._echo: Json = {
            "model": model,
            "background": False,  # background: true is refused
            "conversation": None,  # refused when given
            "prompt": None,  # refused when given
            # accepted and not applied: no limit nor key was used
            "max_tool_calls": None,
            "prompt_cache_key": None,
            "safety_identifier": None,
            "service_tier": "default",  # the one tier served
            "top_logprobs": req.top_logprobs or 0,  # above 0 is refused
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": None,
            },
            "store": stored,
            "temperature": req.temperature,
            "text": {"format": _format_echo(fmt)},
            "tool_choice": (
                {"type": "function", "name": choice.name}
                if choice is not None and not isinstance(choice, str)
                else choice or "auto"
            ),
            "tools": tools,
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "user": req.user,
        }

    def item_id(self, block: Block) -> str:
        item_id = self.item_ids.get(block.index)
        if item_id is None:
            item_id = self.item_ids[block.index] = f"{_ID_PREFIXES[block.kind]}_{uuid.uuid4().hex}"
        return item_id

    def items(self, blocks: list[Block], status: str) -> list[Json]:
        """The output items; the last one has the response's status (cut short or not)."""
        last = len(blocks) - 1
        return [
            output_item(b, self.item_id(b), status if i == last else "completed")
            for i, b in enumerate(blocks)
        ]

    def body(
        self,
        status: str,
        output: list[Json],
        usage: Json | None = None,
        incomplete: Json | None = None,
    ) -> Json:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": incomplete,
            **self._echo,
            "output": output,
            "usage": usage,
        }


def _format_echo(fmt: Any) -> Json:
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt is not None else "text"}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}


Finish = Callable[[BlockReader, StreamDelta], Json]


class ResponseStream:
    """The ``StreamFormat`` (server/streaming.py) of a streamed response; ``finish`` makes the
    final response body (and stores it) from the reader and the final delta."""

    def __init__(self, response: ResponseBody, reader: BlockReader, finish: Finish) -> None:
        self.response = response
        self.reader = reader
        self.finish = finish
        self.sequence = 0

    def _event(self, name: str, /, **body: Any) -> NamedEvent:
        event = NamedEvent(name, {"type": name, "sequence_number": self.sequence, **body})
        self.sequence += 1
        return event

    def opening(self) -> list[NamedEvent]:
        body = self.response.body("in_progress", [])
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def admitted(self, cached_tokens: int | None) -> list[NamedEvent]:
        return []

    def frames(self, delta: StreamDelta) -> list[NamedEvent]:
        frames = []
        for event in self.reader.feed(delta.text, delta.finished):
            status = "completed"
            if event.kind == "stop" and delta.finished:  # the last item ends with the response
                status = status_of(self.reader.finish_reason(delta.finish_reason))[0]
            frames += self._frames(event, status)
        return frames

    def _frames(self, event: BlockEvent, status: str) -> list[NamedEvent]:
        block = event.block
        item_id = self.response.item_id(block)
        at: Json = {"item_id": item_id, "output_index": block.index}
        if block.kind == "tool_call":
            names = (
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
            )
            done_body: Json = {"arguments": block.text, "name": block.name}
        elif block.kind == "reasoning":
            names = ("response.reasoning_text.delta", "response.reasoning_text.done")
            at["content_index"] = 0
            done_body = {"text": block.text}
        else:
            names = ("response.output_text.delta", "response.output_text.done")
            at["content_index"] = 0
            done_body = {"text": block.text, "logprobs": []}
        if event.kind == "delta":
            extra: Json = {"logprobs": []} if block.kind == "text" else {}
            return [self._event(names[0], **at, delta=event.piece, **extra)]
        if event.kind == "start":
            item = output_item(block, item_id, "in_progress", whole=False)
            frames = [
                self._event("response.output_item.added", output_index=block.index, item=item)
            ]
            if block.kind != "tool_call":
                frames.append(
                    self._event("response.content_part.added", **at, part=_part(block, ""))
                )
            return frames
        frames = [self._event(names[1], **at, **done_body)]
        if block.kind != "tool_call":
            part = _part(block, block.text)
            frames.append(self._event("response.content_part.done", **at, part=part))
        item = output_item(block, item_id, status)
        frames.append(self._event("response.output_item.done", output_index=block.index, item=item))
        return frames

    def error(self, error: ApiError) -> NamedEvent:
        """A failure after the headers went out, as OpenAI's ``error`` event."""
        code = error.code or error.type
        return self._event("error", code=code, message=error.message, param=error.param)

    def closing(self, finals: list[StreamDelta]) -> list[NamedEvent]:
        (final,) = finals
        body = self.finish(self.reader, final)
        name = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [self._event(name, response=body)]
