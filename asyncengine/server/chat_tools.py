"""A chat completion's tools, tool choice and reasoning: the prompt the template renders, the
grammar decoding runs under, and how the output is read back (server/chat_output.py).

    plan = plan_chat(req, tokenizer)      # 400 for a tool choice that cannot be honoured
    prompt_ids = engine.tokenize(plan.prompt, add_special_tokens=False)  # the template's own
    params = plan.constrain(params)       # the tool-call grammar, if the choice asks for one

``tool_choice``: "none" (the default without tools) renders no tools and parses no calls;
"auto" (the default with tools) lets the model answer in text or call, a call once begun
being held to the grammar; "required" and a named function make the output calls only.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput
from asyncengine.server.errors import invalid_request
from asyncengine.server.openai_schema import SCHEMA_PARAM, ChatCompletionRequest, chat_messages
from asyncengine.server.tool_schema import (
    AssistantToolCall,
    NamedToolChoice,
    Tool,
    ToolChoiceFunction,
    answers_no_call,
)
from asyncengine.structured.schema_support import check_enforced
from asyncengine.structured.tool_grammar import (
    ToolFunction,
    answer_schema,
    arguments_schema,
    tool_call_grammar,
)
from asyncengine.text.chat_format import ChatFormat, ChatTurn, chat_format, template_messages
from asyncengine.text.reasoning import prompt_closes_thinking, prompt_opens_thinking
from asyncengine.text.tokenizer import ChatTemplateError
from asyncengine.text.tool_calls import ToolCallFormat

# Template variables a request may not set through chat_template_kwargs (the server's own).
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
    }
)


@dataclass(frozen=True, slots=True)
class ChatOutputSpec:
    """How a choice's text is read: calls in ``tool_format`` (None: no calls), reasoning
    split off (None: none; else whether the output starts inside the think block);
    ``calls_only``: the tool choice allows nothing but calls (``required`` or a named
    function), so any other text is the markup of a call cut off by the length limit;
    ``legacy_functions``: the request gave ``functions``, so its call is a
    ``function_call``."""

    tool_format: ToolCallFormat | None
    reasoning_starts_inside: bool | None
    calls_only: bool = False
    legacy_functions: bool = False  # the call read back as ``function_call`` (one at most)
    include_reasoning: bool = True  # vLLM's: False leaves the reasoning out of the reply


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """``output``: how to read the choices (None: as plain text)."""

    prompt: str
    output: ChatOutputSpec | None
    grammar: StructuredOutput | None
    holds_format: bool = False  # the grammar holds the response format's JSON answer too

    def constrain(self, params: SamplingParams) -> SamplingParams:
        if self.grammar is None:
            return params
        if self.output is not None and self.output.calls_only:
            # nothing but calls, each whole by its grammar: a stop string (text's) cuts none,
            # and a response format (text's, as OpenAI's API takes it beside forced calls)
            # has no text to hold
            return dataclasses.replace(params, structured=self.grammar, stop=[])
        if params.structured is not None and not self.holds_format:
            raise invalid_request(
                "regex and ebnf cannot be combined with tools under tool_choice 'auto'",
                param="regex" if params.structured.kind == "regex" else "ebnf",
            )
        return dataclasses.replace(params, structured=self.grammar)


def with_legacy_functions(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """``functions`` / ``function_call`` (OpenAI's legacy names) as ``tools`` /
    ``tool_choice``, with one call at most, as the legacy API made."""
    if req.functions is None and req.function_call is None:
        return req
    if req.tools is not None or req.tool_choice is not None:
        raise invalid_request(
            "give tools and tool_choice, or the legacy functions and function_call, not both",
            param="functions" if req.functions is not None else "function_call",
        )
    if not req.functions and req.function_call not in (None, "none"):
        raise invalid_request(
            "function_call needs functions: send the functions the model may call",
            param="function_call",
        )
    choice = req.function_call
    return msgspec.structs.replace(
        req,
        tools=[Tool(function=function) for function in req.functions or []] or None,
        tool_choice=NamedToolChoice(function=choice)
        if isinstance(choice, ToolChoiceFunction)
        else choice,
        parallel_tool_calls=False,
        functions=None,
        function_call=None,
    )


def _tool_choice(req: ChatCompletionRequest) -> str | NamedToolChoice:
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise invalid_request(
                "tool_choice needs tools: send the functions the model may call",
                param="tool_choice",
            )
        return "none"
    return "auto" if choice is None else choice


def _functions(tools: list[Tool], choice: str | NamedToolChoice) -> list[ToolFunction]:
    functions: dict[str, ToolFunction] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in functions:
            raise invalid_request(
                f"tools[{i}].function.name {name!r} is given twice", param=f"tools[{i}]"
            )
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise invalid_request(
                f"tools[{i}].function.parameters must be a JSON schema of an object",
                param=f"tools[{i}].function.parameters",
            )
        functions[name] = ToolFunction(
            name, True if parameters is None or tool.function.strict is False else parameters
        )
    chosen = list(functions.values())
    if isinstance(choice, NamedToolChoice):
        named = functions.get(choice.function.name)
        if named is None:
            raise invalid_request(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )
        chosen = [named]
    names = {function.name for function in chosen}
    for i, tool in enumerate(tools):
        if tool.function.name in names and _held(tool, choice):
            _check_enforced(functions[tool.function.name], f"tools[{i}].function.parameters")
    return chosen


def _grammar_fields(
    tools: list[Tool], functions: list[ToolFunction], answer: dict[str, Any] | None
) -> tuple[str, tuple[StructuredOutput, ...]]:
    """The field a tool-call grammar's compile error names: the one schema it holds, where it
    holds one (a tool's parameters, or the response format's answer), else ``tools``; and then
    its parts, each schema with its field, so that the compiler names the one at fault."""
    held = {f.name: f for f in functions if isinstance(f.parameters, dict)}
    parts = [
        StructuredOutput.json_schema(
            arguments_schema(held[tool.function.name]), f"tools[{i}].function.parameters"
        )
        for i, tool in enumerate(tools)
        if tool.function.name in held
    ]
    if answer is not None:
        parts.append(StructuredOutput.json_schema(answer_schema(answer), SCHEMA_PARAM))
    if len(parts) == 1:
        return str(parts[0].param), ()
    return "tools", tuple(parts)


def _held(tool: Tool, choice: str | NamedToolChoice) -> bool:
    """Whether the tool's arguments are a constraint the client asked to be held: a strict
    tool, or a choice that makes the output calls. Under "auto" a tool that is not strict
    is described by its schema; a call still keeps to the keywords the grammar enforces."""
    return tool.function.strict is True or choice != "auto"


def _check_enforced(function: ToolFunction, param: str) -> None:
    try:
        check_enforced(function.parameters, param)
    except InvalidRequestError as exc:
        raise invalid_request(str(exc), param=param, code=exc.code) from None


def _turns(req: ChatCompletionRequest) -> list[ChatTurn]:
    turns: list[ChatTurn] = []
    legacy_call: str | None = None  # the id given to the last legacy function_call
    for i, (plain, message) in enumerate(zip(chat_messages(req), req.messages, strict=True)):
        calls = None
        call_id = message.tool_call_id
        if message.function_call is not None:
            if message.role != "assistant" or message.tool_calls:
                raise invalid_request(
                    f"messages[{i}].function_call: only an assistant message without "
                    "tool_calls carries a function_call",
                    param=f"messages[{i}].function_call",
                )
            legacy_call = f"call_{i}"
            message = msgspec.structs.replace(
                message,
                tool_calls=[AssistantToolCall(id=legacy_call, function=message.function_call)],
            )
        if message.role == "function":
            if legacy_call is None:
                raise invalid_request(
                    f"messages[{i}] has role 'function' but no assistant function_call before it",
                    param=f"messages[{i}].role",
                )
            call_id = legacy_call
        if message.tool_calls:
            if message.role != "assistant":
                raise invalid_request(
                    f"messages[{i}].tool_calls: only an assistant message carries tool calls",
                    param=f"messages[{i}].tool_calls",
                )
            calls = [
                (
                    call.id,
                    call.function.name,
                    call.function.arguments
                    if isinstance(call.function.arguments, str)
                    else json.dumps(call.function.arguments, ensure_ascii=False),
                )
                for call in message.tool_calls
            ]
        if message.role == "tool" and call_id is None:
            raise invalid_request(
                f"messages[{i}] has role 'tool' but no tool_call_id",
                param=f"messages[{i}].tool_call_id",
            )
        turns.append(ChatTurn(plain["role"], plain["content"], calls, call_id, message.name))
    return turns


def check_tool_results(req: ChatCompletionRequest) -> None:
    """400 for a tool message whose ``tool_call_id`` names no call of the assistant message
    before it (other tool messages between them), as OpenAI's Chat Completions refuses it; the
    calls may be answered in any order. Anthropic's and Responses' own rules are checked where
    their bodies are translated."""
    calls: set[str] = set()
    asked = "no assistant message with tool_calls comes before it"
    for i, message in enumerate(req.messages):
        if message.role == "tool" and message.tool_call_id is not None:
            if message.tool_call_id not in calls:
                raise answers_no_call(f"messages[{i}].tool_call_id", message.tool_call_id, asked)
        elif message.role not in ("tool", "function"):
            calls = {call.id for call in message.tool_calls or []}
            if message.role != "assistant" or not calls:
                asked = f"messages[{i}] before it is not an assistant message with tool_calls"
            else:
                asked = f"the assistant message before it, messages[{i}], has no such call"


def _template_variables(req: ChatCompletionRequest) -> dict[str, Any]:
    variables = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & variables.keys())
    if reserved:
        raise invalid_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}",
            param="chat_template_kwargs",
        )
    if req.documents is not None:  # vLLM's: for templates that take them (retrieval)
        if "documents" in variables:
            raise invalid_request(
                "documents is given twice (also in chat_template_kwargs)", param="documents"
            )
        variables["documents"] = req.documents
    return variables


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    variables: dict[str, Any],
    add_generation_prompt: bool = True,
    continue_final: bool = False,
) -> str:
    """The chat template's text (``continue_final``: cut after the final message's text, so
    that the model goes on writing it); a template that fails on these inputs is a 400."""
    if tools is not None:
        variables = {**variables, "tools": tools}
    try:
        text = str(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **variables
            )
        )
    except ChatTemplateError as error:
        raise invalid_request(str(error), code="invalid_value") from None
    return open_final_message(text, messages[-1].get("content")) if continue_final else text


def open_final_message(rendered: str, content: object) -> str:
    """``rendered`` up to the end of the final message's text ``content`` (with its trailing
    blanks where the template kept them): the template's end of turn after it dropped."""
    if not isinstance(content, str) or not content.strip():
        raise invalid_request(
            "the final message is continued (continue_final_message, or a last assistant turn "
            "in /v1/messages) but has no text",
            param="messages",
        )
    text = content.strip()
    at = rendered.rfind(text)
    if at < 0:
        raise invalid_request(
            "the chat template does not write the final message's text as given, so it cannot "
            "be continued",
            param="continue_final_message",
        )
    end = at + len(text)
    trailing = content[len(content.rstrip()) :]
    if rendered.startswith(trailing, end):
        end += len(trailing)
    return rendered[:end]


def _generation_prompt(req: ChatCompletionRequest) -> bool:
    """Whether the template opens the reply: not when the final message is continued."""
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid_request(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="add_generation_prompt",
        )
    if req.add_generation_prompt is None:
        return not req.continue_final_message
    return req.add_generation_prompt


def plan_chat(req: ChatCompletionRequest, tokenizer: Any) -> ChatPlan:
    legacy = req.functions is not None
    req = with_legacy_functions(req)
    choice = _tool_choice(req)
    fmt: ChatFormat = chat_format(getattr(tokenizer, "chat_template", None))
    functions = _functions(req.tools or [], choice) if choice != "none" else []
    tools = [msgspec.to_builtins(tool) for tool in req.tools or []] if functions else None
    messages, template_tools = template_messages(_turns(req), fmt, tools)
    prompt = render_prompt(
        tokenizer,
        messages,
        template_tools,
        _template_variables(req),
        _generation_prompt(req),
        req.continue_final_message,
    )
    starts_inside = prompt_opens_thinking(prompt) if fmt.reasons else None
    grammar = None
    answer = _answer_schema(req) if choice == "auto" else None
    if functions:
        mode = "named" if isinstance(choice, NamedToolChoice) else str(choice)
        grammar = tool_call_grammar(
            fmt.tool_format,
            functions,
            mode,
            parallel=req.parallel_tool_calls,
            # thinking turned off in the prompt: the calls come at once, with no block first
            reasoning=starts_inside is not None and not prompt_closes_thinking(prompt),
            starts_inside_thinking=bool(starts_inside),
            answer=answer,
        )
        param, parts = _grammar_fields(req.tools or [], functions, answer)
        grammar = dataclasses.replace(grammar, param=param, parts=parts)
    output = None
    if functions or starts_inside is not None:
        output = ChatOutputSpec(
            fmt.tool_format if functions else None,
            starts_inside,
            calls_only=bool(functions) and choice != "auto",
            legacy_functions=legacy,
            include_reasoning=req.include_reasoning,
        )
    return ChatPlan(prompt, output, grammar, holds_format=answer is not None)


def _answer_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` holds a text answer to (None: none); checked as
    the format alone is, when the sampling parameters are made."""
    fmt = req.response_format
    if fmt is None or fmt.type == "json_object":
        return None if fmt is None else {"type": "object"}
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if fmt.type != "json_schema" or schema is None:
        return None
    return schema if isinstance(schema, dict) else {}  # true: any JSON value
