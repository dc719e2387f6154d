"""Anthropic's Messages API: ``POST /v1/messages`` (streamed or whole) and
``POST /v1/messages/count_tokens``, answered by the chat path: the body is translated into a
chat completion request (server/anthropic_schema.py), runs through the same intake, grammar
and streaming tail as ``/v1/chat/completions``, and its output is read back as Anthropic's
content blocks (server/anthropic_format.py). Errors under ``/v1/messages`` have Anthropic's
shape; the ``anthropic-version`` header is accepted (one version is served) and ``x-api-key``
carries the API key as Anthropic's clients send it (server/app.py).
"""

from __future__ import annotations

import uuid

from aiohttp import web

from asyncengine.server.anthropic_format import (
    MessageStream,
    content_block,
    error_body,
    error_event,
    message_body,
    stop_reason,
    usage_body,
)
from asyncengine.server.anthropic_schema import CountTokensRequest, MessagesRequest, chat_request
from asyncengine.server.body import read_json
from asyncengine.server.chat_request import planned_chat, prepare_chat
from asyncengine.server.completion import generate, outcome_of
from asyncengine.server.errors import ERROR_BODIES
from asyncengine.server.keep_alive import PING_FRAME
from asyncengine.server.off_loop import tokenize
from asyncengine.server.openai_routes import json_response
from asyncengine.server.output_blocks import BlockReader, read_blocks
from asyncengine.server.state import OUTCOME, STATE
from asyncengine.server.streaming import stream_response
from asyncengine.server.tenancy import isolate

MESSAGES_PATH = "/v1/messages"


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, state, MessagesRequest)
    chat_req = isolate(request, state.cache_isolation, chat_request(req))
    chat = await prepare_chat(state, chat_req, max_tokens_param="max_tokens")
    message_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        stream = state.engine.stream(chat.prompt, chat.params, request_id=message_id)
        fmt = MessageStream(
            message_id, chat.model, len(chat.prompt), BlockReader(chat.output), state.shown_usage
        )
        return await stream_response(
            request,
            state,
            stream,
            fmt,
            1,
            done_marker=False,
            error_frame=error_event,
            keep_alive=PING_FRAME,
        )
    (output,) = await generate(state.engine, chat.prompt, chat.params, message_id)
    state.metrics.observe_finished(output.metrics)
    request[OUTCOME] = outcome_of(output.finish_reason)
    reader = read_blocks(chat.output, output.text)
    stop = stop_reason(reader.finish_reason(output.finish_reason), output.matched_stop)
    content = [content_block(block) for block in reader.blocks]
    return json_response(
        message_body(
            message_id, chat.model, content, stop, usage_body(state.shown_usage(output.usage))
        )
    )


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as ``/v1/messages`` would render it (tools and system included)."""
    state = request.app[STATE]
    req = await read_json(request, state, CountTokensRequest)
    state.check_model(req.model)
    plan = await planned_chat(state, chat_request(req))
    return json_response({"input_tokens": len(await tokenize(state.engine, plan.prompt))})


def add_anthropic_routes(app: web.Application) -> None:
    app.router.add_post(MESSAGES_PATH, create_message)
    app.router.add_post(MESSAGES_PATH + "/count_tokens", count_tokens)
    app.setdefault(ERROR_BODIES, {})[MESSAGES_PATH] = error_body
