"""``echo`` on /v1/completions: the prompt put before each choice's text and, with
``logprobs``, its tokens scored (SamplingParams.prompt_logprobs) in the shape OpenAI's legacy
API gives and lm-evaluation-harness reads: one entry per prompt token, the first one's logprob
and alternatives null, then the generated tokens' entries."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.common.outputs import Usage
from asyncengine.common.plan import TokenLogprobs
from asyncengine.server.openai_format import Json, TokenText
from asyncengine.server.state import ServerState
from asyncengine.text.detokenizer import TextOffsets


@dataclass(frozen=True, slots=True)
class Echo:
    text: str  # the prompt as given, or its token ids decoded
    token_ids: list[int]
    scored: bool  # logprobs were asked for
    token_text: TokenText = field(compare=False, repr=False)  # how logprobs name a token
    # alternatives shown per token (the scoring may keep more: prompt_logprobs' own k)
    top_k: int = 0
    # the scores last turned into JSON, and it: the n choices of a prompt carry the same
    # scores (choice 0's), built once (a list per choice would cost n times the scoring's)
    _built: list[tuple[list[TokenLogprobs | None], Json]] = field(
        default_factory=list, compare=False, repr=False
    )

    @classmethod
    def of(
        cls,
        state: ServerState,
        given: str | list[int],
        token_ids: list[int],
        scored: bool,
        token_text: TokenText,
        top_k: int = 0,
    ) -> Echo:
        if isinstance(given, str):
            text = given
        else:
            text = state.engine.tokenizer.decode(token_ids, skip_special_tokens=False)
        return cls(text, list(token_ids), scored, token_text, top_k)

    def logprobs(
        self, state: ServerState, prompt_logprobs: list[TokenLogprobs | None] | None
    ) -> Json | None:
        """The prompt's part of a choice's logprobs (None: none asked for); the caller does
        not change it (the prompt's choices share it)."""
        if not self.scored or prompt_logprobs is None:
            return None
        if self._built:
            scores, built = self._built[0]
            same = len(scores) == len(prompt_logprobs) and all(
                a is b for a, b in zip(scores, prompt_logprobs, strict=True)
            )
            if same:
                return built
        built = self._build(state, prompt_logprobs)
        self._built[:] = [(prompt_logprobs, built)]
        return built

    def _build(self, state: ServerState, prompt_logprobs: list[TokenLogprobs | None]) -> Json:
        # the text is the prompt as given or its ids decoded with special tokens kept: that
        # decode, a token at a time, tells where each token starts in it
        offsets = TextOffsets(state.engine.tokenizer.detokenizer(False))
        return {
            "tokens": [self.token_text(t) for t in self.token_ids],
            "token_logprobs": [None if lp is None else lp.token_logprob for lp in prompt_logprobs],
            "top_logprobs": [
                None if lp is None else {self.token_text(t): v for t, v in lp.top[: self.top_k]}
                for lp in prompt_logprobs
            ],
            "text_offset": offsets.of(self.token_ids, len(self.text)),
        }


def join_logprobs(first: Json, then: Json) -> Json:
    """Completion logprobs of ``first``'s tokens followed by ``then``'s."""
    return {key: first[key] + then[key] for key in first}


def sum_usage(usages: list[Usage]) -> Usage:
    """A batch's usage: its prompts' (each counted once) together, every count added up."""
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
        accepted_speculative_tokens=sum(u.accepted_speculative_tokens for u in usages),
    )
