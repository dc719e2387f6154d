"""How many tokens a request may generate: what it asked for, checked against the context and
the configured limit, or what is left of the context when it asked for nothing.

As vLLM does, a request whose prompt plus ``max_tokens`` would not fit the context is refused
with the numbers (a huge ``max_tokens`` is a client mistake, not a request to run for minutes);
a request without ``max_tokens`` generates up to the context (or the server's default), and
``max_new_tokens_limit`` caps both.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncengine.server.errors import ApiError, invalid_request


@dataclass(frozen=True, slots=True)
class TokenLimits:
    context: int  # max_model_len: prompt + output
    limit: int | None = None  # max_new_tokens_limit


def resolve_max_tokens(
    requested: int | None,
    default: int | None,
    prompt_tokens: int,
    limits: TokenLimits,
    param: str,
) -> int:
    """The request's max new tokens; a 400 ApiError naming ``param`` when it cannot be served.

    ``requested``: the client's value (None: not given); ``default``: what an absent value
    means (None: up to the context).
    """
    room = limits.context - prompt_tokens
    if room < 1:
        raise invalid_request(
            f"the prompt has {prompt_tokens} tokens but the context is {limits.context} tokens "
            "(max_model_len), leaving no room to generate",
            code="context_length_exceeded",
        )
    if requested is None:
        value = room if default is None else min(default, room)
        return value if limits.limit is None else min(value, limits.limit)
    if requested > room:
        raise _too_many(
            f"this model's maximum context length is {limits.context} tokens, but the request "
            f"asks for {prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, "
            f"{requested} to generate); lower {param} to at most {room}",
            param,
        )
    if limits.limit is not None and requested > limits.limit:
        raise _too_many(
            f"{param}={requested} is above this server's limit of {limits.limit} new tokens "
            "per request (max_new_tokens_limit)",
            param,
        )
    return requested


def _too_many(message: str, param: str) -> ApiError:
    return invalid_request(message, param=param, code="context_length_exceeded")
