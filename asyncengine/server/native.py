"""SGLang-style native endpoint: POST /generate.

Request: ``{"text": str} | {"input_ids": [int]}``, ``sampling_params`` (max_new_tokens,
temperature, top_p, top_k, min_p, stop, stop_token_ids, no_stop_trim, ignore_eos, n,
logit_bias, json_schema / regex / ebnf, vLLM's truncate_prompt_tokens, ...), ``stream``, ``rid``,
``lora`` (SGLang's ``lora_path``), ``return_logprob``,
``top_logprobs_num``, ``logprob_start_len`` (with ``return_logprob``, >= 0 also scores the
prompt tokens from that position on: ``meta_info.input_token_logprobs`` /
``input_top_logprobs``, the first token's logprob null; ``max_new_tokens`` 0 then scores
without generating). Response:
``{"text", "output_ids", "meta_info"}`` (with n > 1, a list of n of them, each with its
``index``). Streamed as SSE ``data:`` frames per choice (``index``), ending with
``data: [DONE]``. A ``rid`` is the id ``meta_info`` answers with; in the engine it is the
API key's (``key-<digest prefix>:<rid>``), so that one key's rid neither refuses nor reveals
another key's request in flight. ``text`` is cumulative, as SGLang streams it (with
``incremental_streaming_output``, SGLang's server switch, here per request: only the new text);
``output_ids`` and the logprobs in ``meta_info`` carry only the frame's new tokens (a client
joins them; a cumulative copy in every frame costs the square of the output times top-k), the
prompt's logprobs come once, in the first frame. ``meta_info`` of a non-final frame carries
``id``, ``completion_tokens`` so far and ``finish_reason: null``; the final frame of a choice
carries the usage and timings too.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta, Struct, field

from asyncengine.common.outputs import RequestMetrics, StreamDelta, Usage
from asyncengine.common.plan import TokenLogprobs
from asyncengine.common.sampling_params import (
    MAX_CACHE_SALT_LENGTH,
    MAX_LORA_NAME_LENGTH,
    MAX_TENANT_LENGTH,
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from asyncengine.server.body import read_json
from asyncengine.server.completion import generate, outcome_of
from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.off_loop import tokenize
from asyncengine.server.openai_schema import (
    MinP,
    NonNegativeInt,
    PositiveInt,
    Priority,
    RefusedUnlessFalse,
    RefusedUnlessNull,
    RefusedUnlessTrue,
    RepetitionPenalty,
    Seed,
    TimeoutSeconds,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
    TruncatePromptTokens,
    check_unsupported,
    logit_bias,
)
from asyncengine.server.state import OUTCOME, STATE, ServerState
from asyncengine.server.streaming import stream_response
from asyncengine.server.tenancy import API_KEY_DIGEST, key_tenant

if TYPE_CHECKING:
    from asyncengine.api.engine import Prompt

NATIVE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_RID_LENGTH = 256

NativePenalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NativeTemperature = Annotated[float, Meta(ge=0.0, le=100.0)]


class NativeSamplingParams(Struct, kw_only=True):
    # None: NATIVE_DEFAULT_MAX_NEW_TOKENS; 0 only when the prompt is scored (logprob_start_len)
    max_new_tokens: NonNegativeInt | None = None
    min_new_tokens: NonNegativeInt = 0
    temperature: NativeTemperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    frequency_penalty: NativePenalty = 0.0
    presence_penalty: NativePenalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: Seed | None = None
    sampling_seed: Seed | None = None  # SGLang's name for seed
    n: PositiveInt = 1
    priority: Priority | None = None
    timeout: TimeoutSeconds | None = None
    # structured output (at most one), as SGLang takes them
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    # vLLM's: the prompt cut to its last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    no_stop_trim: bool = False  # the matched stop string ends the text
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id strings to -100..100
    # SGLang's, refused unless their default (NATIVE_SAMPLING_UNSUPPORTED)
    stop_regex: RefusedUnlessNull = None
    structural_tag: RefusedUnlessNull = None
    custom_params: RefusedUnlessNull = None
    spaces_between_special_tokens: RefusedUnlessTrue = True  # (false: with specials skipped)
    # stream_interval is read nowhere: it batches a stream's frames, their joined text the same


NATIVE_SAMPLING_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("stop_regex", None, "stop strings are matched literally (stop)"),
    ("structural_tag", None, "not supported; constrain with json_schema, regex or ebnf"),
    ("custom_params", None, "custom logit processors are not supported"),
)


class GenerateRequest(Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: NativeSamplingParams = field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: Annotated[int, Meta(ge=-1)] = -1  # -1: the prompt is not scored
    incremental_streaming_output: bool = False  # stream frames' text: only the new text
    # scheduling controls: top level as SGLang takes priority, or inside sampling_params
    priority: Priority | None = None
    timeout: TimeoutSeconds | None = None
    user: Annotated[str, Meta(max_length=MAX_TENANT_LENGTH)] | None = None  # the tenant
    cache_salt: Annotated[str, Meta(max_length=MAX_CACHE_SALT_LENGTH)] | None = None
    lora: Annotated[str, Meta(max_length=MAX_LORA_NAME_LENGTH)] | None = None  # an adapter's name
    lora_path: Annotated[str, Meta(max_length=MAX_LORA_NAME_LENGTH)] | None = None  # SGLang's
    # SGLang's, refused unless their default (NATIVE_UNSUPPORTED); read nowhere, as they change
    # nothing a client sees: log_metrics, custom_labels, no_logs (no log line holds a prompt),
    # data_parallel_rank / routed_dp_rank / routing_key (routing hints), extra_key,
    # conversation_id, modalities (no multimodal input)
    input_embeds: RefusedUnlessNull = None
    image_data: RefusedUnlessNull = None
    video_data: RefusedUnlessNull = None
    audio_data: RefusedUnlessNull = None
    token_ids_logprob: RefusedUnlessNull = None
    return_hidden_states: RefusedUnlessFalse = False
    return_entropy: RefusedUnlessFalse = False
    session_params: RefusedUnlessNull = None
    custom_logit_processor: RefusedUnlessNull = None
    bootstrap_host: RefusedUnlessNull = None
    bootstrap_room: RefusedUnlessNull = None
    require_reasoning: RefusedUnlessFalse = False
    background: RefusedUnlessFalse = False


NATIVE_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("input_embeds", None, "prompt embeddings are not supported; send text or input_ids"),
    ("image_data", None, "multimodal input is not supported"),
    ("video_data", None, "multimodal input is not supported"),
    ("audio_data", None, "multimodal input is not supported"),
    ("token_ids_logprob", None, "top_logprobs_num gives the most likely tokens' logprobs"),
    ("return_hidden_states", False, "hidden states are not returned"),
    ("return_entropy", False, "entropy is not returned"),
    ("session_params", None, "sessions are not supported"),
    ("custom_logit_processor", None, "custom logit processors are not supported"),
    ("bootstrap_host", None, "disaggregated prefill is not supported"),
    ("bootstrap_room", None, "disaggregated prefill is not supported"),
    ("require_reasoning", False, "not supported"),
    ("background", False, "background requests are not supported"),
)


def _prompt(req: GenerateRequest) -> Prompt:
    if (req.text is None) == (req.input_ids is None):
        raise invalid_request("give exactly one of text and input_ids", param="text")
    if req.text is not None:
        if isinstance(req.text, str):
            return req.text
        if len(req.text) == 1:
            return req.text[0]
        raise invalid_request(
            f"batched text ({len(req.text)} prompts) is not supported; send one request per prompt",
            param="text",
        )
    ids = req.input_ids or []
    if len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]
    if not ids:
        raise invalid_request("input_ids is empty", param="input_ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise invalid_request(
            "input_ids must be a list of non-negative integers", param="input_ids"
        )
    return list(ids)


def _one_of(name: str, top: Any, inner: Any) -> Any:
    """A control given at the top level or in sampling_params (both: they must agree)."""
    if top is not None and inner is not None and top != inner:
        raise invalid_request(
            f"{name} is given twice with different values ({top} and sampling_params.{name} "
            f"{inner}); give it once",
            param=name,
        )
    return top if top is not None else inner


def _adapter(req: GenerateRequest) -> str | None:
    """The adapter named by ``lora`` or SGLang's ``lora_path`` (both: the same one)."""
    if req.lora is not None and req.lora_path is not None and req.lora != req.lora_path:
        raise invalid_request(
            f"lora {req.lora!r} and lora_path {req.lora_path!r} name different adapters",
            param="lora_path",
        )
    return req.lora if req.lora is not None else req.lora_path


def _logit_bias(sp: NativeSamplingParams) -> dict[int, float]:
    try:
        return logit_bias(sp.logit_bias)
    except ApiError as error:
        error.param = "sampling_params.logit_bias"
        raise


def _structured(sp: NativeSamplingParams) -> StructuredOutput | None:
    given = {
        kind: spec
        for kind, spec in (("json_schema", sp.json_schema), ("regex", sp.regex), ("ebnf", sp.ebnf))
        if spec is not None
    }
    if len(given) > 1:
        raise invalid_request(
            f"give at most one of json_schema, regex and ebnf (got {', '.join(given)})",
            param="sampling_params",
        )
    if not given:
        return None
    ((kind, spec),) = given.items()
    param = f"sampling_params.{kind}"
    if kind == "json_schema":
        return StructuredOutput.json_schema(spec, param)
    assert isinstance(spec, str)
    return StructuredOutput(kind, spec, param)


def _sampling_params(req: GenerateRequest, max_new_tokens: int, max_n: int) -> SamplingParams:
    sp = req.sampling_params
    check_unsupported(req, NATIVE_UNSUPPORTED)
    check_unsupported(sp, NATIVE_SAMPLING_UNSUPPORTED, "sampling_params.")
    if not sp.spaces_between_special_tokens and not sp.skip_special_tokens:
        raise invalid_request(  # (with special tokens skipped there is nothing between them)
            "sampling_params.spaces_between_special_tokens=false is not honoured here: special "
            "tokens are written as the tokenizer decodes them",
            param="sampling_params.spaces_between_special_tokens",
            code="unsupported_parameter",
        )
    priority = _one_of("priority", req.priority, sp.priority)
    if sp.n > max_n:
        raise invalid_request(
            f"sampling_params.n={sp.n} is more samples than this server allows (max_n={max_n})",
            param="sampling_params.n",
        )
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    scores_prompt = _scores_prompt(req)
    if max_new_tokens == 0 and not scores_prompt:
        raise invalid_request(
            "max_new_tokens=0 generates nothing: it needs return_logprob and logprob_start_len "
            ">= 0 (to score the prompt)",
            param="sampling_params.max_new_tokens",
        )
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=sp.min_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty,
            stop=stop,
            include_stop_str_in_output=sp.no_stop_trim,
            stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos,
            skip_special_tokens=sp.skip_special_tokens,
            seed=sp.seed if sp.seed is not None else sp.sampling_seed,
            logprobs=req.return_logprob,
            top_logprobs=req.top_logprobs_num if req.return_logprob else 0,
            prompt_logprobs=req.top_logprobs_num if scores_prompt else None,
            prompt_logprobs_start=max(0, req.logprob_start_len),
            n=sp.n,
            logit_bias=_logit_bias(sp),
            structured=_structured(sp),
            priority=0 if priority is None else priority,
            timeout=_one_of("timeout", req.timeout, sp.timeout),
            tenant=req.user or None,
            cache_salt=req.cache_salt,
            lora=_adapter(req),
        )
    except InvalidRequestError as exc:
        raise invalid_request(str(exc), param="sampling_params", code="invalid_value") from None


def _scores_prompt(req: GenerateRequest) -> bool:
    if req.logprob_start_len >= 0 and not req.return_logprob:
        raise invalid_request(
            "logprob_start_len scores the prompt: it needs return_logprob",
            param="logprob_start_len",
        )
    return req.logprob_start_len >= 0


def _request_id(req: GenerateRequest) -> str:
    if req.rid is None:
        return uuid.uuid4().hex
    if not req.rid or len(req.rid) > MAX_RID_LENGTH:
        raise invalid_request(f"rid must be 1 to {MAX_RID_LENGTH} characters", param="rid")
    if not req.rid.isprintable():  # the id goes into the engine's log lines
        raise invalid_request("rid must be printable (no control characters)", param="rid")
    return req.rid


def _engine_request_id(request: web.Request, request_id: str) -> str:
    """The engine's id for a request: a client's rid within its API key's names (the engine
    refuses a rid already in flight, which must not tell of or block another key's)."""
    digest = request.get(API_KEY_DIGEST)
    return request_id if digest is None else f"{key_tenant(digest)}:{request_id}"


def finish_reason_body(
    reason: str | None, matched: str | int | None, completion_tokens: int
) -> dict[str, Any] | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    if reason == "timeout":
        return {"type": "timeout", "message": "the request ran out of time (timeout)"}
    return {"type": reason, "matched": matched}


class NativeResponder:
    """Builds /generate bodies for one request."""

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        return_logprob: bool,
        text_in_logprobs: bool,
        prompt_ids: list[int] | None = None,
        logprob_start_len: int = -1,
    ) -> None:
        self.state = state
        self.request_id = request_id
        self.return_logprob = return_logprob
        self.text_in_logprobs = text_in_logprobs
        self.token_logprobs: list[list[Any]] = []
        self.top_logprobs: list[list[list[Any]]] = []
        self.prompt_ids = prompt_ids or []
        self.logprob_start_len = logprob_start_len
        self.input_token_logprobs: list[list[Any]] | None = None
        self.input_top_logprobs: list[list[list[Any]] | None] | None = None

    def _entry(self, logprob: float | None, token_id: int) -> list[Any]:
        text = self.state.token_text(token_id) if self.text_in_logprobs else None
        return [logprob, token_id, text]

    def add_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> None:
        if not self.return_logprob or logprobs is None:
            return
        for token_id, lp in zip(token_ids, logprobs, strict=False):
            self.token_logprobs.append(self._entry(lp.token_logprob, token_id))
            self.top_logprobs.append([self._entry(v, t) for t, v in lp.top])

    def add_prompt_logprobs(self, prompt_logprobs: list[TokenLogprobs | None] | None) -> None:
        """The prompt's scores, from ``logprob_start_len`` on (SGLang's input_*_logprobs)."""
        if not self.return_logprob or prompt_logprobs is None:
            return
        start = self.logprob_start_len
        entries = zip(self.prompt_ids[start:], prompt_logprobs[start:], strict=True)
        self.input_token_logprobs = []
        self.input_top_logprobs = []
        for token_id, lp in entries:
            if lp is None:
                self.input_token_logprobs.append(self._entry(None, token_id))
                self.input_top_logprobs.append(None)
            else:
                self.input_token_logprobs.append(self._entry(lp.token_logprob, token_id))
                self.input_top_logprobs.append([self._entry(v, t) for t, v in lp.top])

    def take_new(self) -> None:
        """Forget the logprobs sent: a stream frame carries only those added after it."""
        self.token_logprobs = []
        self.top_logprobs = []
        self.input_token_logprobs = None
        self.input_top_logprobs = None

    def body(
        self,
        text: str,
        output_ids: list[int],
        finish_reason: str | None,
        matched: str | int | None,
        usage: Usage | None,
        metrics: RequestMetrics | None,
        completion_tokens: int | None = None,
    ) -> dict[str, Any]:
        """``completion_tokens``: the output's length so far when ``output_ids`` is a part."""
        generated = len(output_ids) if completion_tokens is None else completion_tokens
        meta: dict[str, Any] = {
            "id": self.request_id,
            "completion_tokens": generated if usage is None else usage.completion_tokens,
            "finish_reason": finish_reason_body(finish_reason, matched, generated),
        }
        if usage is not None:
            meta["prompt_tokens"] = usage.prompt_tokens
            if self.state.report_cached_tokens:
                meta["cached_tokens"] = usage.cached_tokens
            meta["accepted_speculative_tokens"] = usage.accepted_speculative_tokens
        if metrics is not None:
            meta["e2e_latency"] = metrics.e2e
            meta["ttft"] = metrics.ttft
            meta["queue_time"] = metrics.queue_time
        if self.return_logprob:
            meta["output_token_logprobs"] = self.token_logprobs
            meta["output_top_logprobs"] = self.top_logprobs
        if self.input_token_logprobs is not None:
            meta["input_token_logprobs"] = self.input_token_logprobs
            meta["input_top_logprobs"] = self.input_top_logprobs
        return {"text": text, "output_ids": output_ids, "meta_info": meta}


async def generate_handler(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, state, GenerateRequest)
    # a text gets its tokenizer's special tokens (a BOS), as SGLang's /generate tokenizes one
    tokens = await tokenize(state.engine, _prompt(req), add_special_tokens=True)
    prompt = state.engine.intake.truncate(tokens, req.sampling_params.truncate_prompt_tokens)
    max_new_tokens = state.engine.intake.max_new_tokens(
        req.sampling_params.max_new_tokens,
        NATIVE_DEFAULT_MAX_NEW_TOKENS,
        len(prompt),
        "sampling_params.max_new_tokens",
    )
    params = _sampling_params(req, max_new_tokens, state.engine.config.max_n)
    request_id = _request_id(req)
    responders = [
        NativeResponder(
            state,
            request_id,
            req.return_logprob,
            req.return_text_in_logprobs,
            prompt,
            req.logprob_start_len,
        )
        for _ in range(params.n)
    ]
    engine_id = _engine_request_id(request, request_id)
    if req.stream:
        stream = state.engine.stream(prompt, params, request_id=engine_id)
        fmt = _StreamFormat(responders, cumulative_text=not req.incremental_streaming_output)
        return await stream_response(request, state, stream, fmt, params.n)
    outputs = await generate(state.engine, prompt, params, engine_id)
    bodies = []
    for out, responder in zip(outputs, responders, strict=True):
        state.metrics.observe_finished(out.metrics)
        responder.add_logprobs(out.token_ids, out.logprobs)
        responder.add_prompt_logprobs(out.prompt_logprobs)
        body = responder.body(
            out.text, out.token_ids, out.finish_reason, out.matched_stop, out.usage, out.metrics
        )
        bodies.append(_indexed(body, out.index, params.n))
    request[OUTCOME] = outcome_of(*(out.finish_reason for out in outputs))
    reply = bodies[0] if params.n == 1 else bodies
    return web.Response(body=msgspec.json.encode(reply), content_type="application/json")


def _indexed(body: dict[str, Any], index: int, n: int) -> dict[str, Any]:
    """Bodies of an n > 1 request say which choice they belong to."""
    if n > 1:
        body["index"] = index
    return body


class _StreamFormat:
    """SGLang's stream: each frame carries its choice's new tokens and their logprobs, and its
    text so far (``cumulative_text``) or the new text."""

    def __init__(self, responders: list[NativeResponder], cumulative_text: bool) -> None:
        self.responders = responders
        self.cumulative_text = cumulative_text
        self.texts = [""] * len(responders)
        self.generated = [0] * len(responders)

    def opening(self) -> list[dict[str, Any]]:
        return []

    def admitted(self, cached_tokens: int | None) -> list[dict[str, Any]]:
        return []

    def frames(self, delta: StreamDelta) -> list[dict[str, Any]]:
        i = delta.index
        responder = self.responders[i]
        responder.add_logprobs(delta.token_ids, delta.logprobs)
        responder.add_prompt_logprobs(delta.prompt_logprobs)
        self.generated[i] += len(delta.token_ids)
        if self.cumulative_text:
            self.texts[i] += delta.text
        if not (delta.text or delta.token_ids or delta.finished):
            return []
        body = responder.body(
            self.texts[i] if self.cumulative_text else delta.text,
            delta.token_ids,
            delta.finish_reason,
            delta.matched_stop,
            delta.usage,
            delta.metrics,
            self.generated[i],
        )
        responder.take_new()
        return [_indexed(body, i, len(self.responders))]

    def closing(self, finals: list[StreamDelta]) -> list[dict[str, Any]]:
        return []


def add_native_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate_handler)
