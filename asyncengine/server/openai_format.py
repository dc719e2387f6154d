"""OpenAI response bodies: completions, chat completions, their stream chunks, usage, logprobs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from asyncengine.common.outputs import Usage
from asyncengine.common.plan import TokenLogprobs
from asyncengine.text.detokenizer import TextOffsets

TokenText = Callable[[int], str]
TokenBytesOf = Callable[[int], bytes]

Json = dict[str, Any]


def token_id_text(token_id: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids writes it: its id, whatever its text."""
    return f"token_id:{token_id}"


def combined_usage(usages: list[Usage]) -> Usage:
    """One request's usage over its choices: the prompt counted once (it is prefilled once)."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    accepted = sum(u.accepted_speculative_tokens for u in usages)
    return Usage(first.prompt_tokens, completion, first.cached_tokens, accepted)


def usage_body(usage: Usage, cached_tokens: bool = True, reasoning_tokens: int = 0) -> Json:
    """``cached_tokens`` False: without ``prompt_tokens_details`` (server/tenancy.py);
    ``reasoning_tokens``: the output's in think blocks (server/chat_output.py)."""
    body: Json = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": min(reasoning_tokens, usage.completion_tokens),
            # OpenAI's name for output tokens that were accepted predictions (speculative
            # guesses)
            "accepted_prediction_tokens": usage.accepted_speculative_tokens,
        },
    }
    if not cached_tokens:
        del body["prompt_tokens_details"]
    return body


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[TokenLogprobs],
    token_text: TokenText,
    token_bytes: TokenBytesOf,
) -> Json:
    """``bytes``: each token's own bytes, not its decoded text's (a piece of a character decodes
    to U+FFFD alone), so that the bytes of a reply's tokens joined are its text's."""
    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        content.append(
            {
                "token": token_text(token_id),
                "logprob": lp.token_logprob,
                "bytes": list(token_bytes(token_id)),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": v, "bytes": list(token_bytes(t))}
                    for t, v in lp.top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[TokenLogprobs],
    token_text: TokenText,
    offsets: TextOffsets,
    end: int,
) -> Json:
    """``offsets``: the choice's, fed its earlier tokens; ``end``: the length of its text
    returned up to and with these tokens' (no offset goes past it)."""
    return {
        "tokens": [token_text(t) for t in token_ids],
        "token_logprobs": [lp.token_logprob for lp in logprobs],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets.of(token_ids, end),
    }


class ResponseBuilder:
    """Builds the bodies of one chat or text completion (one id, one creation time)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        cached_tokens: bool = True,
        token_text: TokenText | None = None,
    ) -> None:
        self.id = request_id
        self.cached_tokens = cached_tokens  # False: usage without cached_tokens
        self.model = model
        self.chat = chat
        self.token_text = token_text  # how logprobs name a token (None: its decoded text)
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[Json]) -> Json:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(
        self,
        choices: list[tuple[str | Json, str | None, Json | None]],
        usage: Usage,
        reasoning_tokens: int = 0,
    ) -> Json:
        """The whole response; ``choices`` holds (text, finish_reason, logprobs) by index (a
        chat choice's text may be its whole message: server/chat_output.py)."""
        bodies = []
        for index, (text, finish_reason, logprobs) in enumerate(choices):
            content: Json
            if not self.chat:
                content = {"text": text}
            elif isinstance(text, dict):
                content = {"message": text}
            else:
                content = {"message": {"role": "assistant", "content": text}}
            bodies.append(
                {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
            )
        body = self._envelope("chat.completion" if self.chat else "text_completion", bodies)
        body["usage"] = usage_body(usage, self.cached_tokens, reasoning_tokens)
        return body

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: Json | None,
        *,
        first: bool = False,
        include_usage: bool = False,
        index: int = 0,
        delta: Json | None = None,
    ) -> Json:
        """``delta``: a chat chunk's delta as given (reasoning, tool calls), not from ``text``."""
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                if finish_reason is not None and not text and not first:
                    delta = {}
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            body = self._envelope("text_completion", [choice])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage, reasoning_tokens: int = 0) -> Json:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(object_, [])
        body["usage"] = usage_body(usage, self.cached_tokens, reasoning_tokens)
        return body
