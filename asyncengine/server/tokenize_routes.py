"""vLLM's tokenizer endpoints: ``POST /tokenize`` (a text ``prompt``, or chat ``messages``
rendered as ``/v1/chat/completions`` renders them) and ``POST /detokenize``.

A count is what a completion of the same prompt, or a chat completion of the same messages
(tools, template variables, ``add_generation_prompt`` and ``continue_final_message``
included), reports as ``usage.prompt_tokens``: the messages go through the chat route's planning
(server/chat_request.py) and the text through the same tokenizing (server/off_loop.py).
``add_special_tokens`` left out is true for a prompt and false for messages, as on the
completions and the chat completions, so that the counts agree (and as vLLM's /tokenize has
it). A prompt longer than the context is counted, not refused: ``max_model_len`` is in the
answer to compare with.
"""

from __future__ import annotations

from typing import Annotated, Any

from aiohttp import web
from msgspec import Meta, Struct

from asyncengine.api.engine_client import EngineClient
from asyncengine.server.body import read_json
from asyncengine.server.chat_request import planned_chat
from asyncengine.server.errors import invalid_request
from asyncengine.server.off_loop import (
    input_chars,
    run_sized,
    text_prompt_special_tokens,
    tokenize,
)
from asyncengine.server.openai_routes import json_response
from asyncengine.server.openai_schema import (
    CHAT_TEMPLATE_UNSUPPORTED,
    ChatCompletionRequest,
    ChatMessage,
    RefusedUnlessNull,
    TokenId,
    check_unsupported,
)
from asyncengine.server.state import STATE, ServerState
from asyncengine.server.tool_schema import Tool
from asyncengine.text.tokenizer import in_vocabulary

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"


class TokenizeRequest(Struct, kw_only=True):
    """Either ``prompt`` (vLLM's TokenizeCompletionRequest) or ``messages`` (its
    TokenizeChatRequest, whose other fields are read as a chat completion reads them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    # the tokenizer's special tokens (a BOS, say) around the text; None: false
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None  # each token as the vocabulary writes it
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    chat_template: RefusedUnlessNull = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


# set only with messages: with a prompt they would change nothing
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


async def tokenize_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, state, TokenizeRequest)
    state.check_model(req.model, adapters=True)  # an adapter shares the base's tokenizer
    check_unsupported(req, (CHAT_TEMPLATE_UNSUPPORTED,))
    text = await _text(state, req)
    special = (
        bool(req.add_special_tokens)
        if req.messages is not None
        else text_prompt_special_tokens(req.add_special_tokens)
    )
    tokens = await tokenize(state.engine, text, special)
    token_strs = None
    if req.return_token_strs:
        tokenizer = state.engine.tokenizer
        token_strs = await run_sized(
            input_chars(tokens), lambda: [tokenizer.id_to_token(t) or "" for t in tokens]
        )
    return json_response(
        {
            "count": len(tokens),
            "max_model_len": state.engine.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        }
    )


async def _text(state: ServerState, req: TokenizeRequest) -> str:
    """The text to tokenize: the prompt, or the messages as the chat template renders them."""
    if (req.prompt is None) == (req.messages is None):
        raise invalid_request(
            "send either prompt (a text) or messages (a chat), not "
            + ("both" if req.prompt is not None else "neither"),
            param="prompt" if req.prompt is None else "messages",
        )
    if req.messages is None:
        assert req.prompt is not None
        for name in _CHAT_FIELDS:
            if getattr(req, name):
                raise invalid_request(f"{name} applies to messages, not to a prompt", param=name)
        return req.prompt
    chat = ChatCompletionRequest(
        model=req.model,
        messages=req.messages,
        tools=req.tools,
        chat_template_kwargs=req.chat_template_kwargs,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )
    return (await planned_chat(state, chat)).prompt


async def detokenize_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, state, DetokenizeRequest)
    state.check_model(req.model, adapters=True)
    engine = state.engine
    text = await run_sized(input_chars(req.tokens), lambda: _decode(engine, req.tokens))
    return json_response({"prompt": text})


def _decode(engine: EngineClient, tokens: list[int]) -> str:
    """The text of ``tokens``, special tokens kept (as vLLM's: a BOS that /tokenize added comes
    back as its text); a 400 naming ``tokens`` for an id outside the model's vocabulary."""
    in_vocabulary(tokens, engine.vocab_size, encoded=False, param="tokens")
    return str(engine.tokenizer.decode(tokens, skip_special_tokens=False))


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post(TOKENIZE_PATH, tokenize_handler)
    app.router.add_post(DETOKENIZE_PATH, detokenize_handler)
