"""max_tokens against the context and max_new_tokens_limit: refused with the numbers when asked
for too many, up to the context (or the default, or the limit) when not asked at all."""

from __future__ import annotations

import pytest

from asyncengine.server.errors import ApiError
from asyncengine.server.limits import TokenLimits, resolve_max_tokens

CONTEXT = TokenLimits(context=100)
LIMITED = TokenLimits(context=100, limit=30)


@pytest.mark.parametrize(
    ("requested", "default", "prompt", "limits", "expected"),
    [
        (10, None, 20, CONTEXT, 10),
        (80, None, 20, CONTEXT, 80),  # exactly fills the context
        (None, None, 20, CONTEXT, 80),  # nothing asked: up to the context
        (None, 16, 20, CONTEXT, 16),  # nothing asked: the endpoint's default
        (None, 16, 95, CONTEXT, 5),  # ... cut to what the context leaves
        (None, None, 20, LIMITED, 30),  # ... and to the limit
        (30, None, 20, LIMITED, 30),
    ],
)
def test_accepted(
    requested: int | None, default: int | None, prompt: int, limits: TokenLimits, expected: int
) -> None:
    assert resolve_max_tokens(requested, default, prompt, limits, "max_tokens") == expected


@pytest.mark.parametrize(
    ("requested", "prompt", "limits", "says"),
    [
        (81, 20, CONTEXT, ["100 tokens", "101 tokens", "20 in the prompt", "81 to generate", "at most 80"]),
        (10**30, 20, CONTEXT, [str(10**30 + 20), "at most 80"]),
        (31, 20, LIMITED, ["max_tokens=31", "limit of 30", "max_new_tokens_limit"]),
        (5, 100, CONTEXT, ["100 tokens", "max_model_len", "no room"]),
    ],
)  # fmt: skip
def test_refused_with_the_numbers(
    requested: int, prompt: int, limits: TokenLimits, says: list[str]
) -> None:
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(requested, None, prompt, limits, "max_tokens")
    error = info.value
    assert error.status == 400 and error.code == "context_length_exceeded"
    for fragment in says:
        assert fragment in error.message, error.message
