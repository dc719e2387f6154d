"""OpenAI's Responses API: ``POST /v1/responses`` (streamed or whole),
``GET /v1/responses/{response_id}``, ``DELETE /v1/responses/{response_id}`` and
``GET /v1/responses/{response_id}/input_items`` (a page of what its request sent as ``input``,
OpenAI's ``limit``, ``order``, ``after`` and ``before``), answered by the
chat path: the body (after the conversation of ``previous_response_id``, from the store) is
translated into a chat completion request (server/responses_schema.py), runs through the same
intake, grammar and streaming tail as ``/v1/chat/completions``, and its output is read back as
output items (server/responses_format.py). Responses are kept (unless ``store`` is false) in a
bounded in-memory store (server/responses_store.py).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from aiohttp import web

from asyncengine.common.outputs import Usage
from asyncengine.server.body import read_json
from asyncengine.server.chat_output import reasoning_tokens
from asyncengine.server.chat_request import prepare_chat
from asyncengine.server.completion import generate, outcome_of
from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.openai_routes import json_response
from asyncengine.server.output_blocks import BlockReader, read_blocks
from asyncengine.server.responses_format import (
    ResponseBody,
    ResponseStream,
    as_input_item,
    items_page,
    listed_item,
    status_of,
    usage_body,
    with_ids,
)
from asyncengine.server.responses_schema import (
    InputItem,
    ResponsesRequest,
    chat_request,
    check_supported,
    input_items,
    responses_constraint,
    responses_names,
)
from asyncengine.server.responses_store import ResponseStore, not_found
from asyncengine.server.state import OUTCOME, STATE, ServerState
from asyncengine.server.streaming import stream_response
from asyncengine.server.tenancy import API_KEY_DIGEST, isolate

RESPONSES_PATH = "/v1/responses"
RESPONSES_STORE = web.AppKey("responses_store", ResponseStore)
MAX_ITEMS_PAGE = 100  # OpenAI's bounds of ``limit``; 20 when not given
DEFAULT_ITEMS_PAGE = 20

Json = dict[str, Any]


class _Turn:
    """One request's response: its final body from the output, stored when asked."""

    def __init__(
        self,
        state: ServerState,
        store: ResponseStore,
        req: ResponsesRequest,
        items: list[InputItem],
        response: ResponseBody,
        owner: str | None,
    ) -> None:
        self.owner = owner  # the API key's digest: only that key reads the stored response
        self.state = state
        self.store = store
        self.req = req
        self.items = with_ids(items)  # ids that page GET .../input_items
        self.response = response

    def finish(self, reader: BlockReader, finish_reason: str | None, usage: Usage | None) -> Json:
        status, incomplete = status_of(reader.finish_reason(finish_reason))
        output = self.response.items(reader.blocks, status)
        reasoning = "".join(b.text for b in reader.blocks if b.kind == "reasoning")
        counted = reasoning_tokens(self.state.engine.tokenizer, reasoning)
        usage_json = (
            usage_body(self.state.shown_usage(usage), counted) if usage is not None else None
        )
        body = self.response.body(status, output, usage_json, incomplete)
        if self.req.store and self.store.enabled:
            turn = [*self.items, *(as_input_item(item) for item in output)]
            self.store.put(
                self.response.id,
                body,
                turn,
                self.req.previous_response_id,
                self.owner,
                self.req.user,
                inputs=len(self.items),
            )
        return body


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    store = request.app[RESPONSES_STORE]
    req = await read_json(request, state, ResponsesRequest)
    check_supported(req)
    history = []
    if req.previous_response_id is not None:
        history = store.conversation(
            req.previous_response_id,
            request.get(API_KEY_DIGEST),
            req.user,
            request.client_max_size,
        )
    items = input_items(req)
    chat_req = isolate(request, state.cache_isolation, chat_request(req, history, items))
    try:
        chat = await prepare_chat(state, chat_req, "max_output_tokens")
    except ApiError as error:
        raise responses_names(error) from None
    chat = dataclasses.replace(chat, params=responses_constraint(chat.params))
    response_id = f"resp_{uuid.uuid4().hex}"
    response = ResponseBody(response_id, chat.model, req, req.store and store.enabled)
    turn = _Turn(state, store, req, items, response, request.get(API_KEY_DIGEST))
    if req.stream:
        stream = state.engine.stream(chat.prompt, chat.params, request_id=response_id)
        fmt = ResponseStream(
            response,
            BlockReader(chat.output),
            lambda reader, final: turn.finish(reader, final.finish_reason, final.usage),
        )
        return await stream_response(
            request, state, stream, fmt, 1, done_marker=False, error_frame=fmt.error
        )
    (output,) = await generate(state.engine, chat.prompt, chat.params, response_id)
    state.metrics.observe_finished(output.metrics)
    request[OUTCOME] = outcome_of(output.finish_reason)
    reader = read_blocks(chat.output, output.text)
    return json_response(turn.finish(reader, output.finish_reason, output.usage))


async def get_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSES_STORE].get(response_id, request.get(API_KEY_DIGEST))
    if stored is None:
        raise not_found(response_id)
    return web.Response(body=stored.body, content_type="application/json")


async def list_input_items(request: web.Request) -> web.Response:
    """A page of a stored response's input items, under the same ownership as GET."""
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSES_STORE].get(response_id, request.get(API_KEY_DIGEST))
    if stored is None:
        raise not_found(response_id)
    query = request.rel_url.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request(f"order must be 'asc' or 'desc', not {order!r}", param="order")
    items = [listed_item(item) for item in stored.input_items]
    page = items_page(
        items, _limit(query.get("limit")), order == "desc", query.get("after"), query.get("before")
    )
    return json_response(page)


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_ITEMS_PAGE
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_ITEMS_PAGE:
        raise invalid_request(
            f"limit must be an integer from 1 to {MAX_ITEMS_PAGE}, not {text!r}", param="limit"
        )
    return limit


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSES_STORE].delete(response_id, request.get(API_KEY_DIGEST)):
        raise not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def add_responses_routes(app: web.Application, store: ResponseStore) -> None:
    app[RESPONSES_STORE] = store
    app.router.add_post(RESPONSES_PATH, create_response)
    app.router.add_get(RESPONSES_PATH + "/{response_id}", get_response)
    app.router.add_delete(RESPONSES_PATH + "/{response_id}", delete_response)
    app.router.add_get(RESPONSES_PATH + "/{response_id}/input_items", list_input_items)
