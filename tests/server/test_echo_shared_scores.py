"""``echo`` + ``logprobs`` with n choices: a prompt's scores become JSON once, and every choice
carrying them gets that JSON (not n copies of the work); other scores are built afresh."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from asyncengine.common.plan import TokenLogprobs
from asyncengine.server.echo import Echo
from asyncengine.server.state import ServerState


class _Detokenizer:
    def add(self, token_ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)


class _Tokenizer:
    def detokenizer(self, skip_special_tokens: bool = True) -> _Detokenizer:
        return _Detokenizer()


class CountingState:
    def __init__(self) -> None:
        self.looked_up = 0
        self.engine = SimpleNamespace(tokenizer=_Tokenizer())  # the text offsets' decode

    def token_text(self, token_id: int) -> str:
        self.looked_up += 1
        return f"<{token_id}>"


def test_choices_with_the_same_scores_share_their_json() -> None:
    counting = CountingState()
    state = cast(ServerState, counting)
    scores: list[TokenLogprobs | None] = [None] + [
        TokenLogprobs(-1.0 - i, [(i, -0.5), (i + 1, -1.5)]) for i in range(1, 50)
    ]
    echo = Echo("prompt", list(range(50)), scored=True, token_text=counting.token_text, top_k=2)
    first = echo.logprobs(state, scores)
    built = counting.looked_up
    assert built == 50 + 49 * 2  # each prompt token, each alternative
    for _ in range(15):  # the other choices: their own lists of the same entries
        assert echo.logprobs(state, list(scores)) is first
    assert counting.looked_up == built
    assert first is not None
    assert first["token_logprobs"][:3] == [None, -2.0, -3.0]
    other = list(scores)
    other[7] = TokenLogprobs(-9.0, [(7, -0.1), (8, -0.2)])
    rebuilt = cast(dict[str, Any], echo.logprobs(state, other))
    assert rebuilt is not first and rebuilt["token_logprobs"][7] == -9.0
    assert counting.looked_up == 2 * built
