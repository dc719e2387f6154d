"""OpenAI request bodies: msgspec Structs, decoding with exact error messages, SamplingParams.

Unknown fields are accepted and ignored (OpenAI clients send many we have no use for), each
request's named in one warning line (server/unknown_fields.py); the known
ones are type- and range-checked at decode time, so a bad value is a 400 that names the field.
Known fields whose meaning we cannot honour (best_of > 1, beam search, vLLM's other extras in
VLLM_UNSUPPORTED, ...) are refused with a 400 that names them rather than silently ignored.
Tools and reasoning: server/chat_tools.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct, field

from asyncengine.common.sampling_params import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS_CHARS,
    MAX_CACHE_SALT_LENGTH,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PRIORITY,
    MAX_TENANT_LENGTH,
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.json_depth import MAX_JSON_DEPTH, nests_deeper_than
from asyncengine.server.tool_schema import (
    AssistantToolCall,
    FunctionDefinition,
    Tool,
    ToolCallFunction,
    ToolChoice,
    ToolChoiceFunction,
)
from asyncengine.structured.schema_support import check_enforced

MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
# a prompt's last k tokens, -1: as many as the context holds (0 is refused at the intake)
TruncatePromptTokens = Annotated[int, Meta(ge=-1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
# any int64, as vLLM takes it (the sampler uses a seed's two's-complement 64 bits)
Seed = Annotated[int, Meta(ge=-MAX_SEED - 1, le=MAX_SEED)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
TokenId = Annotated[int, Meta(ge=0)]
Priority = Annotated[int, Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]
TimeoutSeconds = Annotated[float, Meta(gt=0.0)]
# OpenAI's bounds on the metadata an object carries
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_LENGTH = 64
MAX_METADATA_VALUE_LENGTH = 512
Metadata = Annotated[
    dict[
        Annotated[str, Meta(max_length=MAX_METADATA_KEY_LENGTH)],
        Annotated[str, Meta(max_length=MAX_METADATA_VALUE_LENGTH)],
    ],
    Meta(max_length=MAX_METADATA_PAIRS),
]
# Fields refused unless they hold their default: the decoder takes any value, so that the 400
# names the field (check_unsupported), and the OpenAPI document says that only the default is
# valid.
RefusedUnlessNull = Annotated[Any, Meta(extra_json_schema={"const": None})]
RefusedUnlessFalse = Annotated[bool, Meta(extra_json_schema={"const": False})]
RefusedUnlessTrue = Annotated[bool, Meta(extra_json_schema={"const": True})]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: RefusedUnlessFalse = False  # vLLM's (usage in every chunk)


class JsonSchemaFormat(Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema_: Any = field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part, read as its text


# "function": a legacy function result (as "tool", answering the legacy call before it)
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(Struct, kw_only=True):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    function_call: ToolCallFunction | None = None  # an assistant's earlier legacy call


class _CommonRequest(Struct, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: PositiveInt | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: Annotated[str, Meta(max_length=MAX_TENANT_LENGTH)] | None = None  # the tenant
    # vLLM's: requests with different salts share no prefix-cache pages
    cache_salt: Annotated[str, Meta(max_length=MAX_CACHE_SALT_LENGTH)] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None  # output constraints SGLang also takes (one at most)
    ebnf: str | None = None
    # vLLM's names for output constraints: refused, since ignored they would leave the output
    # unconstrained with nothing said (response_format, regex and ebnf say the same)
    guided_json: RefusedUnlessNull = None
    guided_regex: RefusedUnlessNull = None
    guided_choice: RefusedUnlessNull = None
    guided_grammar: RefusedUnlessNull = None
    structured_outputs: RefusedUnlessNull = None
    # Extensions that vLLM and SGLang also accept.
    priority: Priority = 0  # lower is served first (the "priority" policy)
    timeout: TimeoutSeconds | None = None  # seconds from arrival, then finish_reason "timeout"
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    # vLLM's: the prompt (chat: the rendered conversation) cut to its last k tokens (-1: as
    # many as the context holds) before it is checked against the context
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    # vLLM's: a text prompt (chat: the rendered conversation) gets its tokenizer's special
    # tokens (a BOS, say); None or false: tokenized as it is (vLLM's default on completions
    # is true)
    add_special_tokens: bool | None = None
    # vLLM's: logprobs name each token "token_id:<id>" (its bytes are still its own)
    return_tokens_as_token_ids: bool | None = None
    allowed_token_ids: list[TokenId] | None = None  # vLLM's: only these may be sampled
    # vLLM's: each prompt token's logprob and rank, with the k most likely tokens there
    # (server/prompt_logprobs.py); not with stream
    prompt_logprobs: TopLogprobs | None = None
    # vLLM's: words the output may not contain (bad_words_token_ids: how they are banned)
    bad_words: list[str] | None = None
    # vLLM's options that nothing here honours: a 400 when set to anything but their default
    # (VLLM_UNSUPPORTED says why each); ignored, they would change the answer with nothing said
    best_of: Annotated[int, Meta(ge=1, extra_json_schema={"maximum": 1})] | None = None
    use_beam_search: RefusedUnlessFalse = False
    length_penalty: Annotated[float, Meta(extra_json_schema={"const": 1.0})] = 1.0
    spaces_between_special_tokens: RefusedUnlessTrue = True  # (false: with specials skipped)
    logits_processors: RefusedUnlessNull = None
    structural_tag: RefusedUnlessNull = None
    guided_whitespace_pattern: RefusedUnlessNull = None
    kv_transfer_params: RefusedUnlessNull = None
    vllm_xargs: RefusedUnlessNull = None


class ChatCompletionRequest(_CommonRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's legacy tools and tool_choice: one call at most (server/chat_tools.py)
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | ToolChoiceFunction | None = None
    # variables for the chat template, e.g. {"enable_thinking": false} (vLLM and SGLang's name)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # vLLM's: the template's documents variable
    # vLLM's: the template's opening of the reply (None: unless continuing), or the final
    # message left open for the model to go on writing (a prefilled start of the reply)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    # vLLM's, refused unless their default (CHAT_UNSUPPORTED)
    echo: RefusedUnlessFalse = False
    chat_template: RefusedUnlessNull = None
    include_reasoning: bool = True  # vLLM's: False leaves reasoning_content out (null)
    # OpenAI's, for its stored completions: nothing is stored here, but a client gets the 400
    # that OpenAI gives for metadata past its bounds
    metadata: Metadata | None = None


class CompletionRequest(_CommonRequest, kw_only=True):
    prompt: str | list[Any]
    max_tokens: NonNegativeInt | None = None  # 0: with echo, the prompt scored, nothing generated
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_embeds: RefusedUnlessNull = None  # vLLM's: refused


# OpenAI's documented default for /v1/completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# the field's path: "at `$.a.b`", a dict's key "at `key` in `$.a`", a dict's value "$.a[...]"
_PATH_RE = re.compile(r"(?:at|in) `\$\.?([^`]*)`")
_MISSING_RE = re.compile(r"(?:missing required|unknown) field `([^`]*)`")

RequestT = TypeVar("RequestT", bound=Struct)


def decode_body(body: bytes, request_type: type[RequestT]) -> RequestT:
    """Decode a JSON body into ``request_type``; raise a 400 ApiError that says what is wrong."""
    if not body.strip():
        raise invalid_request(
            "the request body is empty; expected a JSON object", code="invalid_json"
        )
    if nests_deeper_than(body):
        raise _too_deep()
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH_RE.search(text)
        param = match.group(1).replace("[...]", "") if match and match.group(1) else None
        if missing := _MISSING_RE.search(text):
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        raise invalid_request(
            f"invalid request body: {text}", param=param, code="invalid_value"
        ) from None
    except msgspec.DecodeError as exc:
        raise invalid_request(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except UnicodeDecodeError as exc:  # a string holding bytes that are not UTF-8
        raise invalid_request(
            f"the request body is not valid JSON: a string is not valid UTF-8 "
            f"(byte 0x{exc.object[exc.start]:02x} at offset {exc.start} of that string)",
            code="invalid_json",
        ) from None
    except RecursionError:  # the depth check above makes this a second line of defence
        raise _too_deep() from None


def _too_deep() -> ApiError:
    return invalid_request(
        f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep",
        code="invalid_json",
    )


def _unsupported(param: str, why: str) -> ApiError:
    return invalid_request(f"{param}: {why}", param=param, code="unsupported_parameter")


_VLLM_CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")  # fmt: skip


# vLLM's request fields that are not honoured here: (name, default, why), refused when set to
# anything else (an empty list or object counts as the default)
VLLM_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("best_of", 1, "only 1 is supported (each of the n choices is sampled on its own)"),
    ("use_beam_search", False, "beam search is not supported"),
    ("length_penalty", 1.0, "it scores beams, and beam search is not supported"),
    ("logits_processors", None, "custom logits processors are not supported"),
    ("structural_tag", None, "not supported"),
    ("guided_whitespace_pattern", None, "not supported"),
    ("kv_transfer_params", None, "disaggregated prefill is not supported"),
    ("vllm_xargs", None, "no extension reads them"),
)  # fmt: skip
# vLLM's fields read nowhere, as they change nothing a client sees: request_id (the response's
# id is the server's own), mm_processor_kwargs (no multimodal input: image parts are refused),
# guided_decoding_backend (xgrammar enforces every constraint; the language is the same)
CHAT_TEMPLATE_UNSUPPORTED: tuple[str, object, str] = (
    "chat_template", None, "a request's own chat template is not supported; the model's is used"
)  # fmt: skip
CHAT_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("echo", False, "not supported on chat completions"),
    CHAT_TEMPLATE_UNSUPPORTED,
)
COMPLETION_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("prompt_embeds", None, "prompt embeddings are not supported; send text or token ids"),
)


def check_unsupported(
    req: Struct, unsupported: tuple[tuple[str, object, str], ...], prefix: str = ""
) -> None:
    """A 400 naming the first of ``unsupported`` that ``req`` sets (``prefix``: the object's
    path in the body, e.g. "sampling_params.")."""
    for name, default, why in unsupported:
        value = getattr(req, name)
        if value is not None and value != default and value != [] and value != {}:
            given = msgspec.json.encode(value).decode()
            given = given if len(given) <= 60 else given[:60] + "..."
            param = prefix + name
            raise _unsupported(param, f"{param}={given} is not honoured here: {why}")


def _check_common(req: _CommonRequest, max_n: int) -> None:
    for name in _VLLM_CONSTRAINTS:
        if getattr(req, name) is not None:
            raise _unsupported(
                name,
                f"vLLM's {name} is not read here; constrain the output with response_format "
                "(json_schema or json_object), regex or ebnf",
            )
    check_unsupported(req, VLLM_UNSUPPORTED)
    if not req.spaces_between_special_tokens and not req.skip_special_tokens:
        raise _unsupported(  # (with special tokens skipped there is nothing between them)
            "spaces_between_special_tokens",
            "spaces_between_special_tokens=false is not honoured here: special tokens are "
            "written as the tokenizer decodes them",
        )
    if req.n is not None and req.n > max_n:
        raise invalid_request(
            f"n={req.n} is more choices than this server allows (max_n={max_n})", param="n"
        )
    if req.stream_options is not None and not req.stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if req.prompt_logprobs is not None and req.stream:
        raise invalid_request(
            "prompt_logprobs is not available with stream: true (as in vLLM)",
            param="prompt_logprobs",
        )
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise _unsupported(
            "stream_options.continuous_usage_stats",
            "stream_options.continuous_usage_stats=true is not honoured here: include_usage "
            "sends the usage once, in the last chunk",
        )
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    for i, stop in enumerate(stops):
        if not stop:
            raise invalid_request(f"stop[{i}] is an empty string", param="stop")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` dicts with text content, checked."""
    messages: list[dict[str, str]] = []
    for i, message in enumerate(req.messages):
        param = f"messages[{i}]"
        if message.role not in CHAT_ROLES:
            raise invalid_request(
                f"{param}.role {message.role!r} is not one of {sorted(CHAT_ROLES)}",
                param=f"{param}.role",
            )
        content = message.content
        if content is None:
            if message.role != "assistant":
                raise invalid_request(f"{param}.content is missing", param=f"{param}.content")
            content = ""
        if isinstance(content, list):
            texts: list[str] = []
            for j, part in enumerate(content):
                text = _part_text(part, message.role)
                if text is None:
                    raise invalid_request(
                        f"{param}.content[{j}] has type {part.type!r}; only text parts "
                        "(and an assistant's refusal parts) are supported",
                        param=f"{param}.content[{j}].type",
                        code="unsupported_content",
                    )
                texts.append(text)
            content = "\n".join(texts)
        role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
        messages.append({"role": role, "content": content})
    return messages


def _part_text(part: ContentPart, role: str) -> str | None:
    """A content part's text: a text part's, or the refusal an assistant part carries (the
    OpenAI API takes one in an assistant's content, as vLLM does); None for any other part."""
    if part.type == "text":
        return part.text
    if part.type == "refusal" and role == "assistant":
        return part.refusal
    return None


# the most prompts one completions request may batch (lm-eval sends tens at a time)
MAX_BATCHED_PROMPTS = 1024


def check_fits_queue(count: int, max_waiting: int, param: str) -> None:
    """400 for a batch of more items than the engine queues (each is a request): it could
    never be admitted, and a 503 would have the client retry it for ever."""
    if count > max_waiting:
        raise invalid_request(
            f"{count} batched items are more than the server queues at once "
            f"(max_waiting_requests={max_waiting}); split the batch",
            param=param,
        )


def completion_prompts(req: CompletionRequest, max_waiting: int) -> list[str | list[int]]:
    """The prompts of a completions request: one text or list of token ids, or a batch of
    either (each its own choices, ``n`` per prompt), no more than ``max_waiting``."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid_request("prompt is an empty list", param="prompt")
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if len(prompt) > MAX_BATCHED_PROMPTS:
        raise invalid_request(
            f"{len(prompt)} batched prompts are more than {MAX_BATCHED_PROMPTS}; split the batch",
            param="prompt",
        )
    check_fits_queue(len(prompt), max_waiting, "prompt")
    prompts: list[str | list[int]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(_is_token_id(t) for t in item):
            prompts.append(list(item))
        else:
            raise invalid_request(
                f"prompt[{i}] is neither a string nor a non-empty list of non-negative token ids",
                param="prompt",
            )
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token id strings to -100..100) with the bad entry named; the
    vocabulary bound is checked at intake."""
    bias = bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid_request(
            f"logit_bias has {len(bias)} entries, more than the limit of {MAX_LOGIT_BIAS_ENTRIES}",
            param="logit_bias",
        )
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        # ASCII digits only ("²".isdigit() is true), and few enough for any vocabulary
        if not (key.isascii() and key.isdigit() and len(key) <= _TOKEN_ID_DIGITS):
            raise invalid_request(
                f"logit_bias key {_short(key)} is not a token id (a non-negative integer)",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise invalid_request(
                f"logit_bias[{key}] = {value} is not in [-100, 100]", param="logit_bias"
            )
        parsed[int(key)] = float(value)
    return parsed


_TOKEN_ID_DIGITS = 18  # within int64, far past any vocabulary


def _short(key: str) -> str:
    return repr(key) if len(key) <= 40 else repr(key[:40]) + f"... ({len(key)} characters)"


SCHEMA_PARAM = "response_format.json_schema.schema"


def structured_output(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """The constraint a response_format asks for (None: plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type not in RESPONSE_FORMATS:
        raise invalid_request(
            f"response_format.type {fmt.type!r} is not one of {', '.join(RESPONSE_FORMATS)}",
            param="response_format.type",
        )
    try:
        if fmt.type == "json_object":
            return StructuredOutput("json_object", param="response_format")
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if not isinstance(schema, (dict, bool)):
            raise invalid_request(
                f"{SCHEMA_PARAM} must be a JSON schema object",
                param=SCHEMA_PARAM,
            )
        # its size checked first: the keyword walk is Python, on the event loop
        structured = StructuredOutput.json_schema(schema, param=SCHEMA_PARAM)
        check_enforced(schema, SCHEMA_PARAM)
        return structured
    except InvalidRequestError as exc:
        raise invalid_request(str(exc), exc.param or "response_format", exc.code) from None


def _constraint(req: _CommonRequest) -> StructuredOutput | None:
    """response_format, or the regex / ebnf extension: at most one of them."""
    given = [
        name
        for name, value in (
            (
                "response_format",
                req.response_format is not None and req.response_format.type != "text",
            ),
            ("regex", req.regex is not None),
            ("ebnf", req.ebnf is not None),
        )
        if value
    ]
    if len(given) > 1:
        raise invalid_request(f"give at most one of {', '.join(given)}", param=given[1])
    try:
        if req.regex is not None:
            return StructuredOutput("regex", req.regex, param="regex")
        if req.ebnf is not None:
            return StructuredOutput("ebnf", req.ebnf, param="ebnf")
    except InvalidRequestError as exc:
        raise invalid_request(str(exc), param=given[0]) from None
    return structured_output(req.response_format)


# SamplingParams' fields whose OpenAI request fields are named otherwise
OPENAI_FIELD_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _sampling_params(
    req: _CommonRequest,
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    structured = _constraint(req)
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=stop,
            include_stop_str_in_output=req.include_stop_str_in_output,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            min_new_tokens=req.min_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            n=req.n or 1,
            logit_bias=logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            structured=structured,
            prompt_logprobs=prompt_logprobs,
            priority=req.priority,
            timeout=req.timeout,
            tenant=req.user or None,
            cache_salt=req.cache_salt,
        )
    except InvalidRequestError as exc:
        message, param = str(exc), exc.param
        for engine_name, api_name in OPENAI_FIELD_NAMES.items():  # the names the client sent
            message = message.replace(engine_name, api_name)
        param = OPENAI_FIELD_NAMES.get(param, param) if param is not None else None
        raise invalid_request(message, param=param, code="invalid_value") from None


def bad_words_token_ids(words: list[str] | None, tokenizer: Any) -> list[list[int]]:
    """vLLM's bad_words as the token sequences to ban: each word as it begins the text and as it
    follows a space (vLLM keeps the second only where it is as many tokens as the first, and so
    lets " Raj", one token, through for the bad word "Raj", two)."""
    words = words or []
    if sum(len(word) for word in words) > MAX_BAD_WORDS_CHARS:
        raise invalid_request(
            f"bad_words has more than {MAX_BAD_WORDS_CHARS} characters in all", "bad_words"
        )
    sequences: list[list[int]] = []
    for i, word in enumerate(words):
        word = word.lstrip()
        if not word:
            raise invalid_request(f"bad_words[{i}] is blank", param="bad_words")
        alone = list(tokenizer.encode(word))
        spaced = list(tokenizer.encode(" " + word))
        sequences.append(alone)
        if spaced != alone:
            sequences.append(spaced)
    if sum(len(seq) for seq in sequences) > MAX_BAD_WORD_TOKENS:
        raise invalid_request(
            f"bad_words make more than {MAX_BAD_WORD_TOKENS} tokens in all", "bad_words"
        )
    return sequences


def chat_max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    """The max_tokens the client asked for (None: none) and the field that said it."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def chat_sampling_params(
    req: ChatCompletionRequest, max_tokens: int, max_n: int = 1
) -> SamplingParams:
    """``max_tokens``: the request's, resolved against the context (asyncengine/api/intake.py)."""
    _check_common(req, max_n)
    check_unsupported(req, CHAT_UNSUPPORTED)
    if req.top_logprobs and not req.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    return _sampling_params(
        req, max_tokens, bool(req.logprobs), req.top_logprobs or 0, req.prompt_logprobs
    )


def completion_sampling_params(
    req: CompletionRequest, max_tokens: int, max_n: int = 1
) -> SamplingParams:
    """``max_tokens``: the request's, resolved against the context (asyncengine/api/intake.py)."""
    _check_common(req, max_n)
    check_unsupported(req, COMPLETION_UNSUPPORTED)
    if max_tokens == 0 and not req.echo:
        raise invalid_request(
            "max_tokens=0 generates nothing: it needs echo (to score the prompt)",
            param="max_tokens",
        )
    if req.suffix:
        raise _unsupported("suffix", "suffix is not supported")
    logprobs = req.logprobs is not None
    # echo with logprobs scores the prompt too, with as many alternatives; prompt_logprobs
    # with its own (the scoring keeps the more, each view shows its own)
    scored = req.echo and (logprobs or max_tokens == 0)
    wanted = [
        k for k in ((req.logprobs or 0) if scored else None, req.prompt_logprobs) if k is not None
    ]
    return _sampling_params(
        req, max_tokens, logprobs, req.logprobs or 0, max(wanted) if wanted else None
    )
