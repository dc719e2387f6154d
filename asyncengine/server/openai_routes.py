"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from asyncengine.outputs import StreamDelta
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.engine_request import Prompt, StreamingRequest, generate, outcome_of
from asyncengine.server.errors import ENGINE_ERRORS, from_engine_error
from asyncengine.server.openai_format import (
    Json,
    ResponseBuilder,
    chat_logprobs,
    combined_usage,
    completion_logprobs,
)
from asyncengine.server.openai_schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    chat_sampling_params,
    completion_prompt,
    completion_sampling_params,
    decode_body,
)
from asyncengine.server.sse import ClientGone, SSEWriter
from asyncengine.server.state import OUTCOME, STATE, ServerState


def json_response(body: Json, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(body), content_type="application/json"
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = decode_body(await request.read(), ChatCompletionRequest)
    model = state.check_model(req.model)
    messages = chat_messages(req)
    params = chat_sampling_params(
        req, state.chat_max_tokens(), state.engine.max_model_len, state.engine.config.max_n
    )
    builder = ResponseBuilder(f"chatcmpl-{uuid.uuid4().hex}", model, chat=True)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream:
        return await _stream(request, state, messages, params, builder, include_usage)
    return await _complete(request, state, messages, params, builder)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = decode_body(await request.read(), CompletionRequest)
    model = state.check_model(req.model)
    prompt = completion_prompt(req)
    params = completion_sampling_params(
        req, COMPLETIONS_DEFAULT_MAX_TOKENS, state.engine.max_model_len, state.engine.config.max_n
    )
    builder = ResponseBuilder(f"cmpl-{uuid.uuid4().hex}", model, chat=False)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream:
        return await _stream(request, state, prompt, params, builder, include_usage)
    return await _complete(request, state, prompt, params, builder)


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(
        {"object": "list", "data": [_model_card(state, n) for n in state.served_model_names]}
    )


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    state.check_model(name)
    return json_response(_model_card(state, name))


def _model_card(state: ServerState, name: str) -> Json:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "asyncengine",
        "root": state.engine.model_name,
        "max_model_len": state.engine.max_model_len,
    }


def _logprobs(
    state: ServerState,
    builder: ResponseBuilder,
    token_ids: list[int],
    logprobs: list | None,
    text_offset: int,
) -> Json | None:
    if logprobs is None:
        return None
    if builder.chat:
        return chat_logprobs(token_ids, logprobs, state.token_text)
    return completion_logprobs(token_ids, logprobs, state.token_text, text_offset)


async def _complete(
    request: web.Request,
    state: ServerState,
    prompt: Prompt,
    params: SamplingParams,
    builder: ResponseBuilder,
) -> web.Response:
    outputs = await generate(state.engine, prompt, params, builder.id)
    for output in outputs:
        state.metrics.observe_finished(output.metrics)
    request[OUTCOME] = outcome_of(*(output.finish_reason for output in outputs))
    choices = [
        (o.text, o.finish_reason, _logprobs(state, builder, o.token_ids, o.logprobs, 0))
        for o in outputs
    ]
    return json_response(builder.full(choices, combined_usage([o.usage for o in outputs])))


async def _stream(
    request: web.Request,
    state: ServerState,
    prompt: Prompt,
    params: SamplingParams,
    builder: ResponseBuilder,
    include_usage: bool,
) -> web.StreamResponse:
    call = StreamingRequest(state.engine, prompt, params, builder.id)
    finals: list[StreamDelta] = []  # each choice's last delta; the request ends with all n
    try:
        # Wait for the first delta before sending headers, so that a request the engine refuses
        # (bad input, full queue) is answered with a proper 4xx/503 rather than a broken stream.
        delta = await call.next()
        writer = SSEWriter(request)
        await writer.open()
        try:
            if builder.chat:
                for index in range(params.n):
                    await writer.send(
                        builder.chunk(
                            "", None, None, first=True, include_usage=include_usage, index=index
                        )
                    )
            text_offsets = [0] * params.n
            while delta is not None:
                index = delta.index
                if delta.text or delta.finished or delta.logprobs:
                    logprobs = _logprobs(
                        state, builder, delta.token_ids, delta.logprobs, text_offsets[index]
                    )
                    chunk = builder.chunk(
                        delta.text,
                        delta.finish_reason,
                        logprobs,
                        include_usage=include_usage,
                        index=index,
                    )
                    await writer.send(chunk)
                    text_offsets[index] += len(delta.text)
                if delta.finished:
                    finals.append(delta)
                    state.metrics.observe_finished(delta.metrics)
                    if len(finals) == params.n:
                        break
                delta = await call.next()
            usages = [d.usage for d in sorted(finals, key=lambda d: d.index) if d.usage]
            if include_usage and len(usages) == params.n:
                await writer.send(builder.usage_chunk(combined_usage(usages)))
            await writer.done()
            outcome = outcome_of(*(d.finish_reason for d in finals))
            request[OUTCOME] = "abort" if len(finals) < params.n else outcome
        except ENGINE_ERRORS as exc:
            # Headers are gone: report the failure in-band, as other OpenAI servers do.
            request[OUTCOME] = "error"
            await writer.send(from_engine_error(exc).body())
            await writer.done()
        return writer.response
    except ClientGone:
        request[OUTCOME] = "abort"
        return writer.response
    finally:
        await call.close()


def add_openai_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
