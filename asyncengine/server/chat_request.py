"""A chat request made ready to run: the model it names, the rendered and tokenized prompt
(tools and reasoning through server/chat_tools.py), the sampling parameters with their token
budget resolved, and how its output is read back. Chat Completions, Anthropic's Messages and
OpenAI's Responses all come through here: the last two translate their bodies into a
``ChatCompletionRequest`` first (server/anthropic_schema.py, server/responses_schema.py)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from asyncengine.common.sampling_params import SamplingParams
from asyncengine.server.chat_tools import ChatOutputSpec, ChatPlan, plan_chat
from asyncengine.server.off_loop import run_sized, tokenize
from asyncengine.server.openai_schema import (
    ChatCompletionRequest,
    bad_words_token_ids,
    chat_max_tokens,
    chat_sampling_params,
)
from asyncengine.server.state import ServerState


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """``output``: how to read the choices (None: as plain text)."""

    model: str
    prompt: list[int]
    params: SamplingParams
    output: ChatOutputSpec | None


async def planned_chat(state: ServerState, req: ChatCompletionRequest) -> ChatPlan:
    """``req``'s tools, tool choice, reasoning and rendered prompt. The template renders in
    time proportional to the request: a large one (100,000 short messages: 0.5 s; 20,000
    tools, made into a call grammar: 0.9 s) renders off the loop."""
    tokenizer = state.engine.tokenizer
    return await run_sized(_request_chars(req), lambda: plan_chat(req, tokenizer))


async def prepare_chat(
    state: ServerState, req: ChatCompletionRequest, max_tokens_param: str | None = None
) -> PreparedChat:
    """``max_tokens_param``: the field a refused token budget is named by (default: the chat
    request's own)."""
    model = state.check_model(req.model, adapters=True)
    chat = await planned_chat(state, req)
    # large ones off the loop
    tokens = await tokenize(state.engine, chat.prompt, bool(req.add_special_tokens))
    prompt = state.engine.intake.truncate(tokens, req.truncate_prompt_tokens)
    requested, param = chat_max_tokens(req)
    max_tokens = state.engine.intake.max_new_tokens(
        requested, state.default_chat_max_tokens, len(prompt), max_tokens_param or param
    )
    params = chat.constrain(chat_sampling_params(req, max_tokens, state.engine.config.max_n))
    params.bad_words_token_ids = bad_words_token_ids(req.bad_words, state.engine.tokenizer)
    params.lora = state.lora_for(model)
    return PreparedChat(model, prompt, params, chat.output)


def _request_chars(req: ChatCompletionRequest) -> int:
    """About how many characters the chat template renders for ``req``: the request as JSON,
    since tools, earlier calls' arguments, documents and template variables are rendered (and
    tools made into a grammar) as well as the messages' text."""
    return len(msgspec.json.encode(req))
