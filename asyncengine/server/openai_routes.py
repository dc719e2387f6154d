"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from asyncengine.api.intake import logprob_entries
from asyncengine.common.outputs import StreamDelta, Usage
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.server.body import read_json
from asyncengine.server.chat_output import ChoiceReader, read_choice, reasoning_tokens
from asyncengine.server.chat_request import prepare_chat
from asyncengine.server.chat_tools import ChatOutputSpec, check_tool_results
from asyncengine.server.completion import generate, outcome_of
from asyncengine.server.echo import Echo, join_logprobs, sum_usage
from asyncengine.server.lora_routes import add_lora_routes
from asyncengine.server.merged_stream import MergedStream
from asyncengine.server.off_loop import (
    input_chars,
    run_sized,
    text_prompt_special_tokens,
    tokenize_now,
)
from asyncengine.server.openai_format import (
    Json,
    ResponseBuilder,
    TokenText,
    chat_logprobs,
    combined_usage,
    completion_logprobs,
    token_id_text,
)
from asyncengine.server.openai_schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    bad_words_token_ids,
    completion_prompts,
    completion_sampling_params,
)
from asyncengine.server.prompt_logprobs import prompt_logprobs_body
from asyncengine.server.state import OUTCOME, STATE, ServerState
from asyncengine.server.streaming import stream_response
from asyncengine.text.detokenizer import TextOffsets

if TYPE_CHECKING:
    from asyncengine.api.engine_client import DeltaStream


def json_response(body: Json, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(body), content_type="application/json"
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, state, ChatCompletionRequest)
    check_tool_results(req)
    chat = await prepare_chat(state, req)
    builder = ResponseBuilder(
        f"chatcmpl-{uuid.uuid4().hex}",
        chat.model,
        chat=True,
        cached_tokens=state.report_cached_tokens,
        token_text=token_id_text if req.return_tokens_as_token_ids else None,
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream:
        return await _stream(
            request, state, chat.prompt, chat.params, builder, include_usage, chat.output
        )
    return await _complete(
        request, state, chat.prompt, chat.params, builder, chat.output, req.prompt_logprobs
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """One prompt or a batch (prompt ``i``'s choice ``j`` is choice ``i * n + j``); ``echo``
    puts each prompt before its choices' text, and with ``logprobs`` scores its tokens."""
    state = request.app[STATE]
    req = await read_json(request, state, CompletionRequest)
    model = state.check_model(req.model, adapters=True)
    given = completion_prompts(req, state.engine.config.max_waiting_requests)
    intake = state.engine.intake
    special = text_prompt_special_tokens(req.add_special_tokens)
    tokenized = await run_sized(
        input_chars(given), lambda: [tokenize_now(state.engine, p, special) for p in given]
    )
    prompts: list[list[int]] = [intake.truncate(t, req.truncate_prompt_tokens) for t in tokenized]
    # a cut prompt echoes the tokens kept, not the text given
    given = [
        g if len(p) == len(t) else p for g, p, t in zip(given, prompts, tokenized, strict=True)
    ]
    params = []
    bad_words = bad_words_token_ids(req.bad_words, state.engine.tokenizer)
    for prompt in prompts:
        max_tokens = state.engine.intake.max_new_tokens(
            req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, len(prompt), "max_tokens"
        )
        params.append(completion_sampling_params(req, max_tokens, state.engine.config.max_n))
        params[-1].lora = state.lora_for(model)
        params[-1].bad_words_token_ids = bad_words
    state.engine.intake.check_logprob_entries(
        sum(logprob_entries(len(p), sp) for p, sp in zip(prompts, params, strict=True))
    )
    builder = ResponseBuilder(
        f"cmpl-{uuid.uuid4().hex}",
        model,
        chat=False,
        cached_tokens=state.report_cached_tokens,
        token_text=token_id_text if req.return_tokens_as_token_ids else None,
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    echo = None
    if req.echo:
        scored = req.logprobs is not None
        token_text = _token_text(state, builder)
        echo = [
            Echo.of(state, g, p, scored, token_text, req.logprobs or 0)
            for g, p in zip(given, prompts, strict=True)
        ]
    if len(prompts) == 1 and echo is None:
        if req.stream:
            return await _stream(request, state, prompts[0], params[0], builder, include_usage)
        return await _complete(
            request, state, prompts[0], params[0], builder, None, req.prompt_logprobs
        )
    if req.stream:
        return await _stream_batch(request, state, prompts, params, builder, include_usage, echo)
    return await _complete_batch(
        request, state, prompts, params, builder, echo, req.prompt_logprobs
    )


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    names = [*state.served_model_names, *state.lora_names]
    # OpenAI's list, with the paging fields of Anthropic's (one page holds every model)
    return json_response(
        {
            "object": "list",
            "data": [_model_card(state, n) for n in names],
            "has_more": False,
            "first_id": names[0] if names else None,
            "last_id": names[-1] if names else None,
        }
    )


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    state.check_model(name, adapters=True)
    return json_response(_model_card(state, name))


def _model_card(state: ServerState, name: str) -> Json:
    card: Json = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "asyncengine",
        "root": state.engine.model_name,
        "max_model_len": state.engine.max_model_len,
        # Anthropic's model fields, for its clients (created_at is `created` as RFC 3339)
        "type": "model",
        "display_name": name,
        "created_at": "1970-01-01T00:00:00Z",
    }
    if state.lora_for(name) is not None:  # a LoRA adapter over the base (vLLM's card)
        card["root"] = name
        card["parent"] = state.model_name
    return card


def _text_offsets(
    state: ServerState, prompt_ids: list[int], params: SamplingParams, start: int
) -> TextOffsets:
    """A choice's text offsets, from a decode like the engine's of its text (the prompt's last
    tokens as context, the same special tokens skipped), starting at ``start``."""
    tokenizer = state.engine.tokenizer
    return TextOffsets(tokenizer.detokenizer(params.skip_special_tokens, prompt_ids), start)


def _logprobs(
    state: ServerState,
    builder: ResponseBuilder,
    token_ids: list[int],
    logprobs: list | None,
    offsets: Callable[[], TextOffsets],
    end: int,
) -> Json | None:
    """``offsets``: the choice's text offsets (made only for a text completion's logprobs);
    ``end``: the length of its text returned with these tokens'."""
    if logprobs is None:
        return None
    if builder.chat:
        return chat_logprobs(
            token_ids, logprobs, _token_text(state, builder), state.engine.tokenizer.token_bytes
        )
    return completion_logprobs(token_ids, logprobs, _token_text(state, builder), offsets(), end)


def _token_text(state: ServerState, builder: ResponseBuilder) -> TokenText:
    return builder.token_text or state.token_text


async def _complete(
    request: web.Request,
    state: ServerState,
    prompt: list[int],
    params: SamplingParams,
    builder: ResponseBuilder,
    chat_output: ChatOutputSpec | None = None,
    prompt_logprobs: int | None = None,
) -> web.Response:
    """``prompt_logprobs``: vLLM's field, the top alternatives it shows (None: not asked)."""
    outputs = await generate(state.engine, prompt, params, builder.id)
    for output in outputs:
        state.metrics.observe_finished(output.metrics)
    request[OUTCOME] = outcome_of(*(output.finish_reason for output in outputs))
    choices: list[tuple[str | Json, str | None, Json | None]] = []
    reasoning = 0
    for o in outputs:
        logprobs = _logprobs(
            state,
            builder,
            o.token_ids,
            o.logprobs,
            lambda: _text_offsets(state, prompt, params, 0),
            len(o.text),
        )
        if chat_output is None:
            choices.append((o.text, o.finish_reason, logprobs))
        else:
            message, finish_reason = read_choice(chat_output, o.text, o.finish_reason)
            choices.append((message, finish_reason, logprobs))
            tokenizer = state.engine.tokenizer
            reasoning += reasoning_tokens(tokenizer, message.get("reasoning_content") or "")
            if not chat_output.include_reasoning and "reasoning_content" in message:
                message["reasoning_content"] = None
    usage = _usage([o.usage for o in outputs], params.n)
    body = builder.full(choices, usage, reasoning)
    if prompt_logprobs is not None:
        token_text = _token_text(state, builder)
        shown = [
            prompt_logprobs_body(prompt, o.prompt_logprobs, prompt_logprobs, token_text)
            for o in outputs
        ]
        _add_prompt_logprobs(body, shown)
    return json_response(body)


def _add_prompt_logprobs(body: Json, shown: list[list[Json | None] | None]) -> None:
    """vLLM's places for prompt_logprobs: each text completion choice's, or the chat
    response's (its choices share one prompt)."""
    if body["object"] == "chat.completion":
        body["prompt_logprobs"] = shown[0]
        return
    for choice, value in zip(body["choices"], shown, strict=True):
        choice["prompt_logprobs"] = value


def _usage(usages: list[Usage], n: int) -> Usage:
    """A request's usage from its choices' (by choice index, ``n`` per prompt): each prompt
    counted once (its choices share one prefill), every choice's output."""
    return sum_usage([combined_usage(usages[i : i + n]) for i in range(0, len(usages), n)])


class _ChunkFormat:
    """Chat or text completion chunks: one per delta with text (or logprobs, or the finish),
    each marked with its choice's index, led by the chat's role chunk per choice and followed
    by the usage chunk (all choices together) when asked for."""

    def __init__(
        self,
        state: ServerState,
        builder: ResponseBuilder,
        include_usage: bool,
        choices: int,
        chat_output: ChatOutputSpec | None = None,
        echo: list[Echo] | None = None,
        *,
        n: int,
        offsets_of: Callable[[int, int], TextOffsets] | None = None,
    ) -> None:
        """``n``: choices per prompt (choices ``i * n .. i * n + n - 1`` are prompt ``i``'s);
        ``echo``: each prompt, sent in a chunk of its own before a choice's first;
        ``offsets_of``: a text completion choice's text offsets, from its index and where its
        generated text starts."""
        self.state = state
        self.builder = builder
        self.include_usage = include_usage
        self.choices = choices
        self.text_offsets = [0] * choices
        self.offsets_of = offsets_of
        self.offsets: dict[int, TextOffsets] = {}  # by choice, made at its first logprobs
        self.echo = echo
        self.n = n
        self.echoed = [False] * choices
        # a chat's text read as reasoning, content and tool calls (server/chat_output.py)
        self.readers = [ChoiceReader(chat_output) for _ in range(choices)] if chat_output else None

    def opening(self) -> list[Json]:
        """Each choice's role chunk: content "" for plain text (as OpenAI's), null where the
        answer may be calls alone (the reader sends its text as it comes)."""
        if not self.builder.chat:
            return []
        role = {"role": "assistant", "content": None} if self.readers else None
        return [
            self.builder.chunk(
                "",
                None,
                None,
                first=True,
                include_usage=self.include_usage,
                index=index,
                delta=dict(role) if role else None,
            )
            for index in range(self.choices)
        ]

    def admitted(self, cached_tokens: int | None) -> list[Json]:
        return []

    def frames(self, delta: StreamDelta) -> list[Json]:
        echoed = self._echo(delta)
        if not (delta.text or delta.finished or delta.logprobs):
            return echoed
        index = delta.index
        end = self.text_offsets[index] + len(delta.text)
        logprobs = _logprobs(
            self.state,
            self.builder,
            delta.token_ids,
            delta.logprobs,
            lambda: self._offsets(index),
            end,
        )
        self.text_offsets[index] = end
        finish_reason, payload = delta.finish_reason, None
        if self.readers is not None:
            reader = self.readers[index]
            payload = reader.feed(delta.text, final=delta.finished)
            if payload is None and not delta.finished and logprobs is None:
                return []  # held back (a marker maybe cut)
            payload = payload or {}
            finish_reason = reader.finish_reason(finish_reason)
        chunk = self.builder.chunk(
            delta.text,
            finish_reason,
            logprobs,
            include_usage=self.include_usage,
            index=index,
            delta=payload,
        )
        return [*echoed, chunk]

    def _offsets(self, index: int) -> TextOffsets:
        offsets = self.offsets.get(index)
        if offsets is None:
            assert self.offsets_of is not None, "a text completion stream is given offsets_of"
            offsets = self.offsets[index] = self.offsets_of(index, self.text_offsets[index])
        return offsets

    def _echo(self, delta: StreamDelta) -> list[Json]:
        """The prompt's chunk, before the choice's first."""
        index = delta.index
        if self.echo is None or self.echoed[index]:
            return []
        self.echoed[index] = True
        prompt = self.echo[index // self.n]
        logprobs = prompt.logprobs(self.state, delta.prompt_logprobs)
        self.text_offsets[index] = len(prompt.text)
        chunk = self.builder.chunk(
            prompt.text, None, logprobs, include_usage=self.include_usage, index=index
        )
        return [chunk]

    def closing(self, finals: list[StreamDelta]) -> list[Json]:
        usages = [d.usage for d in finals if d.usage is not None]
        if self.include_usage and len(usages) == self.choices:
            tokenizer = self.state.engine.tokenizer
            reasoning = sum(reasoning_tokens(tokenizer, r.reasoning) for r in self.readers or [])
            return [self.builder.usage_chunk(_usage(usages, self.n), reasoning)]
        return []


async def _complete_batch(
    request: web.Request,
    state: ServerState,
    prompts: list[list[int]],
    params: list[SamplingParams],
    builder: ResponseBuilder,
    echo: list[Echo] | None,
    prompt_logprobs: int | None = None,
) -> web.Response:
    """Completions of a batch of prompts (or an echoed one), run together; ``prompt_logprobs``
    as ``_complete``'s."""
    ids = _request_ids(builder, len(prompts))
    tasks = [
        asyncio.ensure_future(generate(state.engine, prompt, p, rid))
        for prompt, p, rid in zip(prompts, params, ids, strict=True)
    ]
    try:
        per_prompt = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one failing cancels (aborts) the others
            task.cancel()
        raise
    outputs = [o for outs in per_prompt for o in outs]
    for output in outputs:
        state.metrics.observe_finished(output.metrics)
    request[OUTCOME] = outcome_of(*(output.finish_reason for output in outputs))
    choices: list[tuple[str | Json, str | None, Json | None]] = []
    for i, outs in enumerate(per_prompt):
        for o in outs:
            if echo is None:
                logprobs = _logprobs(
                    state,
                    builder,
                    o.token_ids,
                    o.logprobs,
                    partial(_text_offsets, state, prompts[i], params[i], 0),
                    len(o.text),
                )
                choices.append((o.text, o.finish_reason, logprobs))
                continue
            prompt = echo[i]
            logprobs = prompt.logprobs(state, o.prompt_logprobs)
            if logprobs is not None and o.logprobs is not None:
                start = len(prompt.text)
                offsets = _text_offsets(state, prompts[i], params[i], start)
                generated = completion_logprobs(
                    o.token_ids,
                    o.logprobs,
                    _token_text(state, builder),
                    offsets,
                    start + len(o.text),
                )
                logprobs = join_logprobs(logprobs, generated)
            choices.append((prompt.text + o.text, o.finish_reason, logprobs))
    body = builder.full(choices, _usage([o.usage for o in outputs], params[0].n))
    if prompt_logprobs is not None:
        token_text = _token_text(state, builder)
        shown = [
            prompt_logprobs_body(prompts[i], o.prompt_logprobs, prompt_logprobs, token_text)
            for i, outs in enumerate(per_prompt)
            for o in outs
        ]
        _add_prompt_logprobs(body, shown)
    return json_response(body)


def _request_ids(builder: ResponseBuilder, count: int) -> list[str]:
    return [builder.id] if count == 1 else [f"{builder.id}-p{i}" for i in range(count)]


async def _stream_batch(
    request: web.Request,
    state: ServerState,
    prompts: list[list[int]],
    params: list[SamplingParams],
    builder: ResponseBuilder,
    include_usage: bool,
    echo: list[Echo] | None,
) -> web.StreamResponse:
    n = params[0].n
    streams: list[DeltaStream] = []
    try:
        for prompt, p, rid in zip(
            prompts, params, _request_ids(builder, len(prompts)), strict=True
        ):
            streams.append(state.engine.stream(prompt, p, request_id=rid))
    except BaseException:
        for stream in streams:  # a later prompt refused: the earlier ones go too
            await stream.aclose()
        raise
    fmt = _ChunkFormat(
        state,
        builder,
        include_usage,
        n * len(prompts),
        echo=echo,
        n=n,
        offsets_of=lambda index, start: _text_offsets(
            state, prompts[index // n], params[index // n], start
        ),
    )
    return await stream_response(request, state, MergedStream(streams, n), fmt, n * len(prompts))


async def _stream(
    request: web.Request,
    state: ServerState,
    prompt: list[int],
    params: SamplingParams,
    builder: ResponseBuilder,
    include_usage: bool,
    chat_output: ChatOutputSpec | None = None,
) -> web.StreamResponse:
    stream = state.engine.stream(prompt, params, request_id=builder.id)
    fmt = _ChunkFormat(
        state,
        builder,
        include_usage,
        params.n,
        chat_output,
        n=params.n,
        offsets_of=lambda _, start: _text_offsets(state, prompt, params, start),
    )
    return await stream_response(request, state, stream, fmt, params.n)


def add_openai_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    add_lora_routes(app)
