"""max_tokens against the context and max_new_tokens_limit (the intake, shared by the server's
routes and the Python API): refused with the numbers when asked for too many, up to the context
(or the default, or the limit) when not asked at all."""

from __future__ import annotations

import pytest

from asyncengine.api.intake import Intake
from asyncengine.common.config import EngineConfig
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.server.errors import from_engine_error

CONTEXT = Intake(None, 1000, 100, EngineConfig())
LIMITED = Intake(None, 1000, 100, EngineConfig(max_new_tokens_limit=30))


@pytest.mark.parametrize(
    ("requested", "default", "prompt", "intake", "expected"),
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
    requested: int | None, default: int | None, prompt: int, intake: Intake, expected: int
) -> None:
    assert intake.max_new_tokens(requested, default, prompt, "max_tokens") == expected


@pytest.mark.parametrize(
    ("requested", "prompt", "intake", "says"),
    [
        (81, 20, CONTEXT, ["100 tokens", "101 tokens", "20 in the prompt", "81 to generate", "at most 80"]),
        (10**30, 20, CONTEXT, [str(10**30 + 20), "at most 80"]),
        (31, 20, LIMITED, ["max_tokens=31", "limit of 30", "max_new_tokens_limit"]),
        (5, 100, CONTEXT, ["100 tokens", "max_model_len", "no room"]),
    ],
)  # fmt: skip
def test_refused_with_the_numbers(
    requested: int, prompt: int, intake: Intake, says: list[str]
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        intake.max_new_tokens(requested, None, prompt, "max_tokens")
    error = from_engine_error(info.value)  # what the server answers
    assert error.status == 400 and error.code == "context_length_exceeded"
    for fragment in says:
        assert fragment in error.message, error.message


def test_the_python_api_is_held_to_the_same_limits() -> None:
    ids = list(range(1, 21))
    assert LIMITED.accept(ids, SamplingParams(max_new_tokens=30))[0] == ids
    with pytest.raises(InvalidRequestError, match="max_new_tokens=31 is above"):
        LIMITED.accept(ids, SamplingParams(max_new_tokens=31))
    with pytest.raises(InvalidRequestError, match="no room"):
        CONTEXT.accept(list(range(1, 101)), None)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        CONTEXT.accept([1, 1000], None)
    with pytest.raises(InvalidRequestError, match="stop token id 1000"):
        CONTEXT.accept(ids, SamplingParams(stop_token_ids=[1000]))
    tokenized = CONTEXT.tokenize(ids)
    assert CONTEXT.tokenize(tokenized) is tokenized  # what the routes tokenized is not again
