"""OpenAI Responses request bodies (``POST /v1/responses``) as msgspec Structs, and their
translation into the ``ChatCompletionRequest`` that the chat path runs
(server/chat_request.py).

- ``input``: a string (one user turn) or items: messages (``role`` and string or parts content:
  ``input_text`` / ``output_text`` / ``refusal``; ``input_image``, ``input_file`` and
  ``input_audio`` are refused: no such model is served), ``function_call`` (an earlier call),
  ``function_call_output`` (its result: every call needs one, as in OpenAI's API) and
  ``reasoning`` (dropped: templates drop earlier reasoning). ``item_reference`` is refused.
- ``instructions``: the system turn, first; not carried over by ``previous_response_id``
  (as OpenAI's API does), whose conversation (its input and output items, back along its chain)
  comes before ``input`` (server/responses_store.py).
- Function tools only (``type`` "function"); ``tool_choice`` none / auto / required /
  ``{"type": "function", "name"}``; ``parallel_tool_calls``. A tool is strict unless its
  ``strict`` is false (OpenAI's default here, unlike Chat Completions): its schema is held to
  the grammar (a keyword it cannot hold is a 400), and one whose ``strict`` was left out is
  made strict as OpenAI's API does it, every object's properties all required.
- ``text.format``: text, json_object or json_schema (structured output, as
  ``response_format`` in Chat Completions).
- ``reasoning.effort`` "none" sets the template's ``enable_thinking`` false; other efforts leave
  the template's default (there is no budget to scale); ``reasoning.summary`` is not made
  (reasoning items carry the reasoning text itself).
- ``user`` is the tenant; ``store`` false keeps the response out of the store; ``include`` is
  accepted and ignored (reasoning text is always included, never encrypted).
- Refused: ``background`` true, ``truncation`` "auto", ``conversation``, ``prompt`` (a
  prompt template stored with OpenAI) and ``top_logprobs`` above 0 (no logprobs are written).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from asyncengine.common.sampling_params import MAX_TENANT_LENGTH, SamplingParams
from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    Metadata,
    PositiveInt,
    ResponseFormat,
    Temperature,
    TopP,
)
from asyncengine.server.tool_schema import (
    AssistantToolCall,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolCallFunction,
    ToolChoice,
    ToolChoiceFunction,
    answers_no_call,
)

# items of one conversation: a request's input, or the stored chain that previous_response_id
# continues (each GET of input items and each continuation decodes them all)
MAX_CONVERSATION_ITEMS = 4096


class InputText(Struct, tag="input_text", tag_field="type", kw_only=True):
    text: str


class OutputText(Struct, tag="output_text", tag_field="type", kw_only=True):
    text: str


class RefusalPart(Struct, tag="refusal", tag_field="type", kw_only=True):
    refusal: str


class ReasoningText(Struct, tag="reasoning_text", tag_field="type", kw_only=True):
    text: str


class SummaryText(Struct, tag="summary_text", tag_field="type", kw_only=True):
    text: str


class InputImage(Struct, tag="input_image", tag_field="type", kw_only=True):
    image_url: str | None = None
    file_id: str | None = None


class InputFile(Struct, tag="input_file", tag_field="type", kw_only=True):
    file_id: str | None = None
    filename: str | None = None


class InputAudio(Struct, tag="input_audio", tag_field="type", kw_only=True):
    input_audio: dict[str, Any] | None = None


ContentPart = (
    InputText
    | OutputText
    | RefusalPart
    | ReasoningText
    | SummaryText
    | InputImage
    | InputFile
    | InputAudio
)

ItemType = Literal[
    "message", "function_call", "function_call_output", "reasoning", "item_reference"
]
ItemRole = Literal["user", "assistant", "system", "developer"]


class InputItem(Struct, kw_only=True, omit_defaults=True):
    """One item of ``input`` (the fields its ``type`` uses; a message may omit ``type``)."""

    type: ItemType = "message"
    id: str | None = None
    role: ItemRole | None = None
    content: str | list[ContentPart] | None = None  # a message's, or a reasoning item's text
    status: str | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: FunctionName | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[ContentPart] | None = None  # function_call_output
    summary: list[ContentPart] | None = None  # reasoning
    encrypted_content: str | None = None  # reasoning


class FunctionTool(Struct, kw_only=True):
    type: str = "function"
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Struct, kw_only=True):
    type: str
    name: FunctionName | None = None


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: Any = field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None


class ReasoningConfig(Struct, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[InputItem], Meta(max_length=MAX_CONVERSATION_ITEMS)]
    instructions: str | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: Annotated[str, Meta(max_length=MAX_TENANT_LENGTH)] | None = None  # the tenant
    store: bool = True
    stream: bool = False
    metadata: Metadata | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # variables for the chat template (vLLM's and SGLang's extension)
    chat_template_kwargs: dict[str, Any] | None = None


def check_supported(req: ResponsesRequest) -> None:
    for param, refused, why in (
        ("background", req.background is True, "background responses are not served"),
        ("truncation", req.truncation == "auto", "only truncation 'disabled' is served"),
        (
            "conversation",
            req.conversation is not None,
            "conversations are not served; continue one with previous_response_id",
        ),
        (
            "prompt",
            req.prompt is not None,
            "stored prompt templates are not served; send instructions and input",
        ),
        ("top_logprobs", bool(req.top_logprobs), "logprobs are not served on this API"),
    ):
        if refused:
            raise invalid_request(f"{param}: {why}", param=param, code="unsupported_parameter")


def input_items(req: ResponsesRequest) -> list[InputItem]:
    if isinstance(req.input, str):
        return [InputItem(role="user", content=req.input)]
    return list(req.input)


def _text(parts: str | list[ContentPart] | None, param: str) -> str:
    if parts is None:
        return ""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, (InputImage, InputFile, InputAudio)):
            raise invalid_request(
                f"{param}[{j}] is an {part.__struct_config__.tag} part; this server reads "
                "text only (no vision or audio model is served)",
                param=f"{param}[{j}]",
                code="unsupported_content",
            )
        texts.append(part.refusal if isinstance(part, RefusalPart) else part.text)
    return "\n".join(texts)


def _missing(param: str, what: str) -> ApiError:
    return invalid_request(f"{param} needs {what}", param=param)


def _messages(instructions: str | None, items: list[InputItem], first: int) -> list[ChatMessage]:
    """``first``: the index of ``items[first]`` in the request's ``input`` (the items before
    it come from the previous response)."""
    out: list[ChatMessage] = []
    if instructions:
        out.append(ChatMessage(role="system", content=instructions))
    names: dict[str, str] = {}  # call_id -> function name
    unanswered: dict[str, str] = {}  # call_id -> where its function_call is
    for i, item in enumerate(items):
        param = f"input[{i - first}]" if i >= first else "previous_response_id"
        if item.type == "message":
            if item.role is None or item.content is None:
                raise _missing(param, "a role and content")
            role = "system" if item.role == "developer" else item.role
            out.append(ChatMessage(role=role, content=_text(item.content, f"{param}.content")))
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise _missing(param, "call_id, name and arguments")
            names[item.call_id] = item.name
            unanswered[item.call_id] = param
            call = AssistantToolCall(
                id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments)
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # one turn: its text and calls
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise _missing(param, "call_id and output")
            if item.call_id not in names:
                raise answers_no_call(
                    f"{param}.call_id",
                    item.call_id,
                    "no function_call with this call_id comes before it in input or in the "
                    "previous_response_id conversation",
                )
            unanswered.pop(item.call_id, None)
            output = _text(item.output, f"{param}.output")
            out.append(
                ChatMessage(
                    role="tool",
                    content=output,
                    tool_call_id=item.call_id,
                    name=names.get(item.call_id),
                )
            )
        elif item.type == "item_reference":
            raise invalid_request(
                f"{param}: item references are not served; send the item itself",
                param=param,
                code="unsupported_value",
            )
        # reasoning items: templates drop earlier reasoning
    for call_id, param in unanswered.items():  # OpenAI's rule: every call gets its output
        raise invalid_request(
            f"no function_call_output answers the function_call {call_id!r} ({param}): "
            "send one with its call_id",
            param="input",
        )
    if not out:
        raise invalid_request("input holds no message", param="input")
    return out


def _tools(req: ResponsesRequest) -> list[Tool] | None:
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise invalid_request(
                f"tools[{i}] has type {tool.type!r}: only function tools are served",
                param=f"tools[{i}].type",
                code="unsupported_value",
            )
        if tool.name is None:
            raise _missing(f"tools[{i}]", "a name")
        parameters = tool.parameters
        if tool.strict is None and parameters is not None:
            parameters = all_required(parameters)
        definition = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=parameters,
            strict=tool.strict is not False,
        )
        tools.append(Tool(function=definition))
    return tools or None


_SUBSCHEMAS = ("items", "additionalProperties", "not")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def all_required(schema: Any) -> Any:
    """``schema`` with every object's listed properties required: how OpenAI's Responses API
    makes a function's schema strict when the tool leaves ``strict`` out (an optional field
    is one whose type allows null). A new object; ``schema`` is left as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = all_required(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [all_required(sub) for sub in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: all_required(sub) for name, sub in out[key].items()}
    if isinstance(out.get("properties"), dict):
        out["required"] = list(out["properties"])
    return out


_RESPONSES_NAMES = (
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"\bresponse_format(?:\.json_schema)?"), "text.format"),
)


def _responses_name(text: str) -> str:
    for pattern, name in _RESPONSES_NAMES:
        text = pattern.sub(name, text)
    return text


def responses_names(error: ApiError) -> ApiError:
    """``error`` from the chat path with the fields named as this API has them: a tool's as
    its flat tools (``tools[0].parameters``, not ``tools[0].function.parameters``), the
    structured output's as ``text.format``."""
    error.message = _responses_name(error.message)
    if error.param is not None:
        error.param = _responses_name(error.param)
    return error


def responses_constraint(params: SamplingParams) -> SamplingParams:
    """``params`` with its constraint's fields (named should it not compile) as this API has
    them."""
    structured = params.structured
    if structured is None or structured.param is None:
        return params
    parts = tuple(
        dataclasses.replace(part, param=_responses_name(part.param or ""))
        for part in structured.parts
    )
    named = dataclasses.replace(structured, param=_responses_name(structured.param), parts=parts)
    return dataclasses.replace(params, structured=named)


def _tool_choice(req: ResponsesRequest) -> ToolChoice | None:
    choice = req.tool_choice
    if not isinstance(choice, FunctionToolChoice):
        return choice
    if choice.type != "function" or choice.name is None:
        raise invalid_request(
            "tool_choice: only 'none', 'auto', 'required' or {'type': 'function', 'name': ...} "
            "are served",
            param="tool_choice",
            code="unsupported_value",
        )
    return NamedToolChoice(function=ToolChoiceFunction(name=choice.name))


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    return ResponseFormat(
        type="json_schema",
        json_schema=JsonSchemaFormat(name=fmt.name, schema_=fmt.schema_, strict=fmt.strict),
    )


def _template_variables(req: ResponsesRequest) -> dict[str, Any] | None:
    variables = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort == "none":
        variables["enable_thinking"] = False
    return variables or None


def chat_request(
    req: ResponsesRequest, history: list[InputItem], items: list[InputItem]
) -> ChatCompletionRequest:
    """The chat completion that answers ``req``: ``history`` (the previous response's
    conversation), then ``items`` (its input)."""
    return ChatCompletionRequest(
        model=req.model,
        messages=_messages(req.instructions, [*history, *items], len(history)),
        tools=_tools(req),
        tool_choice=_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        user=req.user,
        stream=req.stream,
        response_format=_response_format(req),
        chat_template_kwargs=_template_variables(req),
    )
