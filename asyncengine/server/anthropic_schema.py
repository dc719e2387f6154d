"""Anthropic Messages request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``) as
msgspec Structs, and their translation into the ``ChatCompletionRequest`` that the chat path
runs (server/chat_request.py): one intake, one tool-call grammar and parser, one reasoning
split for every API.

- ``system``: a string or text blocks; ``messages``: user and assistant turns whose content is
  a string or blocks: ``text``, ``tool_use`` (an assistant's call), ``tool_result`` (a user's
  answer to one, in the message right after the call: every call answered, as Anthropic's
  API has it), ``thinking`` / ``redacted_thinking`` (dropped: templates drop earlier
  reasoning). ``image`` and ``document`` blocks are refused (no vision model is served).
- Text as Anthropic's API takes it: every message has content (a final assistant turn may
  not), no text block is empty or blank, and a final assistant turn does not end with
  whitespace; else a 400 naming the message.
- A conversation that ends with an assistant turn (Anthropic's "prefill") is continued: the
  prompt stops after its text and the reply is what the model writes next. An empty final
  assistant turn is no prefill: the reply starts afresh.
- ``tool_choice``: auto, any (a call is required), tool (that one), none;
  ``disable_parallel_tool_use`` allows one call at most. Server and typed tools
  (``web_search_...``, ``bash_...``, ``text_editor_...``) are refused with a 400 that says
  so: only custom tools (``name``, ``input_schema``, ``strict``) are served.
- ``thinking``: "enabled" / "adaptive" / "between_tools" / "disabled" set the template's
  ``enable_thinking`` (absent: the template's default). ``budget_tokens`` is checked but not
  enforced apart: reasoning counts against ``max_tokens``.
- ``output_config.format`` (``{"type": "json_schema", "schema"}``): structured output, as
  ``response_format`` in Chat Completions; ``output_config.effort`` is ignored. The top-level
  ``output_format`` of Anthropic's structured-outputs beta is read the same way.
- Refused, since nothing here could honour them: ``mcp_servers`` (the server would have to
  call the MCP servers) and ``container`` (code execution). ``context_management``, which
  Claude Code sends on every request, is accepted: earlier thinking is dropped anyway, and
  no tool result is cleared (the conversation is read as sent).
- ``metadata.user_id`` is the tenant (fair-share policies, per-tenant metrics).
- A top-level field this API does not know (a misspelt ``max_token``, another API's
  ``ignore_eos``) is a 400 naming it, as in Anthropic's API ("extra inputs are not
  permitted"): ignored, the client's setting would be lost unawares. Anthropic's fields about
  its own platform (``cache_control``, ``service_tier``, ``inference_geo``, ``speed``) are
  accepted and ignored: caching is automatic here, and there is one tier, region and speed.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from asyncengine.common.sampling_params import MAX_TENANT_LENGTH
from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    PositiveInt,
    ResponseFormat,
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

AnthropicTemperature = Annotated[float, Meta(ge=0.0, le=1.0)]


class TextBlockParam(Struct, tag="text", tag_field="type", kw_only=True):
    text: str


class ImageBlockParam(Struct, tag="image", tag_field="type", kw_only=True):
    source: dict[str, Any] | None = None


class DocumentBlockParam(Struct, tag="document", tag_field="type", kw_only=True):
    source: dict[str, Any] | None = None


class ToolUseBlockParam(Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: Annotated[str, Meta(min_length=1)]
    name: FunctionName
    input: dict[str, Any] = field(default_factory=dict)


ToolResultPart = TextBlockParam | ImageBlockParam | DocumentBlockParam


class ToolResultBlockParam(Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: Annotated[str, Meta(min_length=1)]
    content: str | list[ToolResultPart] = ""
    is_error: bool = False


class ThinkingBlockParam(Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlockParam(Struct, tag="redacted_thinking", tag_field="type", kw_only=True):
    data: str = ""


ContentBlockParam = (
    TextBlockParam
    | ImageBlockParam
    | DocumentBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
)


class MessageParam(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(Struct, kw_only=True):
    """A custom tool; Anthropic's typed tools (``web_search_20250305``, ``bash_20250124``,
    ...) have no ``input_schema``, so it is checked after the type, which refuses them."""

    name: FunctionName
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" (or absent); other types are Anthropic's typed tools
    strict: bool | None = None  # the arguments held to input_schema, as in Chat Completions


class ToolChoiceAuto(Struct, tag="auto", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Struct, tag="any", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Struct, tag="tool", tag_field="type", kw_only=True):
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Struct, tag="none", tag_field="type", kw_only=True):
    pass


AnthropicToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(Struct, tag="enabled", tag_field="type", kw_only=True):
    budget_tokens: PositiveInt | None = None


class ThinkingAdaptive(Struct, tag="adaptive", tag_field="type", kw_only=True):
    pass


class ThinkingBetweenTools(Struct, tag="between_tools", tag_field="type", kw_only=True):
    pass


class ThinkingDisabled(Struct, tag="disabled", tag_field="type", kw_only=True):
    pass


ThinkingConfig = ThinkingEnabled | ThinkingAdaptive | ThinkingBetweenTools | ThinkingDisabled


class JsonOutputFormat(Struct, kw_only=True):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = field(name="schema")


class OutputConfig(Struct, kw_only=True):
    format: JsonOutputFormat | None = None


class MessagesMetadata(Struct, kw_only=True):
    user_id: Annotated[str, Meta(max_length=MAX_TENANT_LENGTH)] | None = None  # the tenant


class CountTokensRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/messages/count_tokens``: what the prompt is made of. An unknown top-level
    field is refused (as Anthropic's API does); blocks inside keep unknown fields (Claude Code
    sends ``cache_control`` on them), as they change nothing served."""

    model: str | None = None
    messages: Annotated[list[MessageParam], Meta(min_length=1)]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # variables for the chat template (vLLM's and SGLang's extension)
    chat_template_kwargs: dict[str, Any] | None = None
    # Anthropic's server-side features: read only to refuse them (_check_served)
    mcp_servers: Any = None
    container: Any = None
    # the structured output of /v1/messages; a grammar on the output, so no token counted
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's name
    # knowingly ignored: earlier thinking is dropped anyway and no tool result is cleared
    context_management: Any = None
    # knowingly ignored, Anthropic's platform: the prefix cache is automatic, and there is one
    # service tier, one region and one speed
    cache_control: Any = None
    service_tier: Any = None
    inference_geo: Any = None
    speed: Any = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: PositiveInt  # required, as Anthropic's API has it
    stream: bool = False
    temperature: AnthropicTemperature | None = None
    top_p: TopP | None = None
    top_k: PositiveInt | None = None
    stop_sequences: list[str] | None = None
    metadata: MessagesMetadata | None = None


def _text_of(parts: list[ToolResultPart], param: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, TextBlockParam):
            raise _unsupported_content(f"{param}[{j}]", part)
        texts.append(part.text)
    return "\n".join(texts)


def _unsupported_content(param: str, block: Any) -> ApiError:
    kind = "an image" if isinstance(block, ImageBlockParam) else "a document"
    return invalid_request(
        f"{param} is {kind} block; this server reads text only (no vision model is served)",
        param=param,
        code="unsupported_content",
    )


def _check_answered(i: int, message: MessageParam, called: set[str]) -> None:
    """Anthropic's rule: every tool_use block is answered by a tool_result block in the
    message right after it."""
    blocks = [] if isinstance(message.content, str) else message.content
    answered = {b.tool_use_id for b in blocks if isinstance(b, ToolResultBlockParam)}
    missing = sorted(called - answered)
    if missing:
        raise invalid_request(
            f"messages[{i - 1}] has tool_use ids that messages[{i}] answers with no "
            f"tool_result block: {', '.join(missing)}; each tool_use block needs a "
            "tool_result block in the next message",
            param=f"messages[{i}].content",
        )


def _check_text(i: int, message: MessageParam, last: bool) -> None:
    """Anthropic's rules for a message's text: content that is not empty (the final assistant
    turn, a prefill, may be), text blocks that are not empty nor blank, and a prefill that does
    not end with whitespace."""
    param = f"messages[{i}].content"
    prefill = last and message.role == "assistant"
    if not message.content and not prefill:
        raise invalid_request(
            f"{param} is empty: all messages must have non-empty content except for the "
            "optional final assistant message",
            param=param,
        )
    if isinstance(message.content, str):
        texts = [(param, message.content)]
    else:
        texts = [
            (f"{param}[{j}].text", block.text)
            for j, block in enumerate(message.content)
            if isinstance(block, TextBlockParam)
        ]
        for where, text in texts:
            if not text:
                raise invalid_request(f"{where}: text content blocks must be non-empty", where)
    for where, text in texts:
        if text and not text.strip() and not prefill:
            raise invalid_request(
                f"{where}: text content blocks must contain non-whitespace text", where
            )
    ending = message.content if isinstance(message.content, str) else ""
    if message.content and isinstance(message.content[-1], TextBlockParam):
        ending = message.content[-1].text
    if prefill and ending and ending != ending.rstrip():
        raise invalid_request(
            f"{param}: final assistant content cannot end with trailing whitespace",
            param=param,
        )


# Anthropic's API refuses calls and results a request gives no tools for, in these words
TOOLS_NEEDED = "Requests which include `tool_use` or `tool_result` blocks must define tools."


def _messages(req: CountTokensRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if req.system:
        system = req.system
        if isinstance(system, list):
            system = "\n".join(block.text for block in system)
        out.append(ChatMessage(role="system", content=system))
    names: dict[str, str] = {}  # tool_use id -> function name
    used_at: dict[str, str] = {}  # tool_use id -> the block that used it first
    asked: set[str] = set()  # the tool_use ids of the message before, which results answer
    for i, message in enumerate(req.messages):
        called, asked = asked, set()
        _check_text(i, message, i == len(req.messages) - 1)
        _check_answered(i, message, called)
        if not message.content:  # an empty final assistant turn (_check_text): no prefill
            continue
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
            continue
        texts: list[str] = []
        calls: list[AssistantToolCall] = []
        for j, block in enumerate(message.content):
            param = f"messages[{i}].content[{j}]"
            if isinstance(block, (ToolUseBlockParam, ToolResultBlockParam)) and not req.tools:
                raise invalid_request(TOOLS_NEEDED, param=param)
            if isinstance(block, TextBlockParam):
                texts.append(block.text)
            elif isinstance(block, (ImageBlockParam, DocumentBlockParam)):
                raise _unsupported_content(param, block)
            elif isinstance(block, ToolUseBlockParam):
                if message.role != "assistant":
                    raise invalid_request(
                        f"{param}: a tool_use block belongs in an assistant message", param=param
                    )
                if block.id in used_at:  # Anthropic's rule: a result must name one call
                    raise invalid_request(
                        f"{param}: tool_use ids must be unique; {block.id!r} is also the id "
                        f"of {used_at[block.id]}",
                        param=param,
                    )
                used_at[block.id] = param
                names[block.id] = block.name
                asked.add(block.id)
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    AssistantToolCall(
                        id=block.id, function=ToolCallFunction(name=block.name, arguments=arguments)
                    )
                )
            elif isinstance(block, ToolResultBlockParam):
                if message.role != "user":
                    raise invalid_request(
                        f"{param}: a tool_result block belongs in a user message", param=param
                    )
                if block.tool_use_id not in called:  # Anthropic's rule: the turn just before
                    raise answers_no_call(
                        f"{param}.tool_use_id",
                        block.tool_use_id,
                        f"the message before it, messages[{i - 1}], has no tool_use block "
                        "with this id"
                        if i
                        else "no message comes before it",
                    )
                if texts:  # text before the result keeps its place
                    out.append(ChatMessage(role="user", content="\n".join(texts)))
                    texts = []
                result = block.content
                if isinstance(result, list):
                    result = _text_of(result, f"{param}.content")
                if block.is_error:
                    result = f"Error: {result}"
                out.append(
                    ChatMessage(
                        role="tool",
                        content=result,
                        tool_call_id=block.tool_use_id,
                        name=names.get(block.tool_use_id),
                    )
                )
            # thinking and redacted_thinking blocks: templates drop earlier reasoning
        if message.role == "assistant":
            out.append(
                ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None)
            )
        elif texts:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _tools(req: CountTokensRequest) -> tuple[list[Tool] | None, ToolChoice | None, bool]:
    """The tools, the tool choice and whether parallel calls are allowed."""
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise invalid_request(
                f"tools[{i}] has type {tool.type!r}: Anthropic's server tools (web search, "
                "code execution, ...) and typed tools (bash, text editor, computer use, ...) "
                "are not served here; only custom tools (name, input_schema)",
                param=f"tools[{i}].type",
                code="unsupported_value",
            )
        if tool.input_schema is None:
            raise invalid_request(
                f"tools[{i}].input_schema is missing: a custom tool needs the JSON schema of "
                "its input",
                param=f"tools[{i}].input_schema",
            )
        definition = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=tool.input_schema,
            strict=tool.strict,
        )
        tools.append(Tool(function=definition))
    choice = req.tool_choice
    parallel = not getattr(choice, "disable_parallel_tool_use", False)
    if choice is None or (isinstance(choice, ToolChoiceAuto) and not tools):
        return tools or None, None, parallel
    if isinstance(choice, ToolChoiceTool):
        named = NamedToolChoice(function=ToolChoiceFunction(name=choice.name))
        return tools or None, named, parallel
    if isinstance(choice, ToolChoiceAny):
        return tools or None, "required", parallel
    return tools or None, "none" if isinstance(choice, ToolChoiceNone) else "auto", parallel


def _template_variables(req: CountTokensRequest) -> dict[str, Any] | None:
    variables = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        variables["enable_thinking"] = not isinstance(req.thinking, ThinkingDisabled)
    return variables or None


_NOT_SERVED = {
    "mcp_servers": "MCP servers are not called by this server; send their tools as custom tools",
    "container": "code execution containers are not served",
}


def _check_served(req: CountTokensRequest) -> None:
    for param, why in _NOT_SERVED.items():
        if getattr(req, param) is not None:
            raise invalid_request(f"{param}: {why}", param=param, code="unsupported_parameter")


def _output_format(req: MessagesRequest) -> JsonOutputFormat | None:
    configured = req.output_config.format if req.output_config is not None else None
    if configured is not None and req.output_format is not None:
        raise invalid_request(
            "send the output format once: output_config.format or output_format, not both",
            param="output_format",
        )
    return configured or req.output_format


def _prefills(req: CountTokensRequest) -> bool:
    """Whether the conversation ends with a prefill: a final assistant turn with content, the
    start of the reply, which the model goes on writing (an empty one is as if absent)."""
    last = req.messages[-1]
    return last.role == "assistant" and bool(last.content)


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion that answers ``req`` (a ``MessagesRequest`` with its sampling)."""
    _check_served(req)
    tools, choice, parallel = _tools(req)
    chat = ChatCompletionRequest(
        model=req.model,
        messages=_messages(req),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=_template_variables(req),
        continue_final_message=_prefills(req),
    )
    if isinstance(req, MessagesRequest):
        chat.max_tokens = req.max_tokens
        chat.temperature = req.temperature
        chat.top_p = req.top_p
        chat.top_k = req.top_k
        chat.stop = req.stop_sequences
        chat.stream = req.stream
        chat.user = req.metadata.user_id if req.metadata is not None else None
        fmt = _output_format(req)
        if fmt is not None:
            chat.response_format = ResponseFormat(
                type="json_schema", json_schema=JsonSchemaFormat(schema_=fmt.schema_)
            )
    return chat
