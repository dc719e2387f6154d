"""vLLM's ``prompt_logprobs`` on /v1/completions (each choice's) and /v1/chat/completions (the
response's): one entry per prompt token, null for the first (nothing comes before it), then a
map from token id (a string, as JSON keys are) to ``{"logprob", "rank", "decoded_token"}``
holding the prompt token itself and the ``k`` most likely tokens at that position (ranks 1 to
k; the prompt token's rank is its own). The scores are the engine's prompt scoring
(SamplingParams.prompt_logprobs), the ones ``echo`` with ``logprobs`` shows too."""

from __future__ import annotations

from asyncengine.common.plan import TokenLogprobs
from asyncengine.server.openai_format import Json, TokenText


def prompt_logprobs_body(
    prompt_ids: list[int],
    scores: list[TokenLogprobs | None] | None,
    k: int,
    token_text: TokenText,
) -> list[Json | None] | None:
    """The field's value for a prompt of ``prompt_ids`` whose scores are ``scores`` (None:
    not scored) with its top ``k`` alternatives."""
    if scores is None:
        return None
    body: list[Json | None] = []
    for token, score in zip(prompt_ids, scores, strict=True):
        if score is None:
            body.append(None)
            continue
        entry = {str(token): _logprob(score.token_logprob, score.rank, token_text(token))}
        for place, (other, logprob) in enumerate(score.top[:k], start=1):
            entry.setdefault(str(other), _logprob(logprob, place, token_text(other)))
        body.append(entry)
    return body


def _logprob(logprob: float, rank: int | None, text: str) -> Json:
    return {"logprob": logprob, "rank": rank, "decoded_token": text}
