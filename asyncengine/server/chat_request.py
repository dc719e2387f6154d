"""A chat request made ready to run: the model it names, the rendered and tokenized prompt
(tools and reasoning through server/chat_tools.py), the sampling parameters with their token
budget resolved, and how its output is read back. Chat Completions, Anthropic's Messages and
OpenAI's Responses all come through here: the last two translate their bodies into a
``ChatCompletionRequest`` first (server/anthropic_schema.py, server/responses_schema.py)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncengine.common.sampling_params import SamplingParams
from asyncengine.server.chat_tools import ChatOutputSpec, plan_chat
from asyncengine.server.off_loop import tokenize
from asyncengine.server.openai_schema import (
    ChatCompletionRequest,
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


async def prepare_chat(
    state: ServerState, req: ChatCompletionRequest, max_tokens_param: str | None = None
) -> PreparedChat:
    """``max_tokens_param``: the field a refused token budget is named by (default: the chat
    request's own)."""
    model = state.check_model(req.model, adapters=True)
    chat = plan_chat(req, state.engine.tokenizer)  # tools, tool choice, reasoning
    prompt = await tokenize(state.engine, chat.prompt)  # large ones off the loop
    requested, param = chat_max_tokens(req)
    max_tokens = state.engine.intake.max_new_tokens(
        requested, state.default_chat_max_tokens, len(prompt), max_tokens_param or param
    )
    params = chat.constrain(chat_sampling_params(req, max_tokens, state.engine.config.max_n))
    params.lora = state.lora_for(model)
    return PreparedChat(model, prompt, params, chat.output)
