"""Intake: a request's input tokenized and validated once, for the Python API and the server.

``AsyncEngine.stream`` (and so ``generate``) runs every request through ``accept``; the HTTP
routes call ``tokenize`` and ``max_new_tokens`` first (the OpenAI defaults for an absent
``max_tokens`` need the prompt's length), and the ``TokenIds`` that ``tokenize`` returns are
not tokenized or range-checked again when the engine accepts them. Every refusal is an
``InvalidRequestError`` (with the request field it is about, and an error code where the
OpenAI API names one), raised before anything is queued.

How many tokens a request may generate: as vLLM does, a request whose prompt plus
``max_tokens`` would not fit the context is refused with the numbers (a huge ``max_tokens`` is
a client mistake, not a request to run for minutes); a request without it generates up to the
context (or the front end's default), and ``max_new_tokens_limit`` caps both. A request may
ask for its prompt to be cut to its last tokens first (vLLM's ``truncate_prompt_tokens``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, TypeVar

from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import UnknownAdapterError
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.structured.schema_support import check_enforced
from asyncengine.text.tokenizer import prompt_token_ids

Prompt = str | list[int] | list[dict[str, Any]]
CONTEXT_EXCEEDED = "context_length_exceeded"


class TokenIds(list[int]):
    """A prompt's token ids as the intake gave them: already in the vocabulary."""


IdsT = TypeVar("IdsT", bound=list[int])


@dataclass(frozen=True, slots=True)
class Intake:
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    config: EngineConfig
    # the LoRA adapters served now: name -> its current load's key (api/lora_adapters.py)
    lora_keys: dict[str, str] = field(default_factory=dict)

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> TokenIds:
        """The token ids the engine would queue for ``prompt`` (chat messages go through the
        chat template); ``InvalidRequestError`` for a prompt it would refuse.
        ``add_special_tokens``: a text prompt gets those its tokenizer adds (a BOS), as vLLM's."""
        if isinstance(prompt, TokenIds):
            return prompt
        ids = prompt_token_ids(self.tokenizer, prompt, self.vocab_size, add_special_tokens)
        return TokenIds(ids)

    def truncate(self, ids: IdsT, keep: int | None) -> IdsT:
        """``ids`` cut to their last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``: -1
        keeps as many as the context holds, None all of them); a ``keep`` that is not an
        integer >= 1 or -1, or that is past the context, is refused."""
        if keep is None:
            return ids
        if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={keep!r} must be an integer >= 1, or -1 (the context)",
                param="truncate_prompt_tokens",
            )
        if keep > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={keep} is more than the context of "
                f"{self.max_model_len} tokens (max_model_len)",
                param="truncate_prompt_tokens",
                code=CONTEXT_EXCEEDED,
            )
        keep = self.max_model_len if keep == -1 else keep
        return ids if len(ids) <= keep else type(ids)(ids[-keep:])

    def max_new_tokens(
        self, requested: int | None, default: int | None, prompt_tokens: int, param: str
    ) -> int:
        """The request's max new tokens: ``requested`` (None: not given, then ``default``, and
        None there means up to the context), checked against the context and the limit."""
        room = self._room(prompt_tokens, scoring_only=requested == 0)
        limit = self.config.max_new_tokens_limit
        if requested is None:
            value = room if default is None else min(default, room)
            return value if limit is None else min(value, limit)
        if requested > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"request asks for {prompt_tokens + requested} tokens ({prompt_tokens} in the "
                f"prompt, {requested} to generate); lower {param} to at most {room}",
                param=param,
                code=CONTEXT_EXCEEDED,
            )
        self._check_limit(requested, param)
        return requested

    def check_logprob_entries(self, entries: int) -> None:
        """Refuse a request whose logprobs (``logprob_entries``, summed over its prompts) are
        above ``max_logprob_entries``: their scoring, copies and JSON grow with it."""
        budget = self.config.max_logprob_entries
        if entries > budget:
            raise InvalidRequestError(
                f"the request asks for {entries} logprobs (scored positions x (alternatives + 1)"
                f" x n, over its prompts), more than this engine's budget of {budget} "
                "(max_logprob_entries): ask for fewer positions, alternatives or choices",
                param="logprobs",
            )

    def _check_limit(self, requested: int, param: str) -> None:
        limit = self.config.max_new_tokens_limit
        if limit is not None and requested > limit:
            raise InvalidRequestError(
                f"{param}={requested} is above this engine's limit of {limit} new tokens per "
                "request (max_new_tokens_limit)",
                param=param,
                code=CONTEXT_EXCEEDED,
            )

    def accept(
        self, prompt: Prompt, params: SamplingParams | None
    ) -> tuple[TokenIds, SamplingParams]:
        """The prompt's token ids and the parameters, validated: what the engine queues."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        params = self._keyed_lora(params)
        ids = self.tokenize(prompt, params.add_special_tokens)
        ids = self.truncate(ids, params.truncate_prompt_tokens)
        self._room(len(ids), scoring_only=params.max_new_tokens == 0)
        self._check_limit(params.max_new_tokens, "max_new_tokens")
        vocab = self.vocab_size
        for name, param, named in (
            ("stop token", "stop_token_ids", params.stop_token_ids),
            ("logit_bias token", "logit_bias", params.logit_bias),
            ("allowed token", "allowed_token_ids", params.allowed_token_ids or []),
            (
                "bad word token",
                "bad_words_token_ids",
                chain.from_iterable(params.bad_words_token_ids),
            ),
        ):
            bad = [t for t in named if t >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"{name} id {bad[0]} is outside the vocabulary [0, {vocab})", param=param
                )
        self.check_logprob_entries(logprob_entries(len(ids), params))
        if params.n > self.config.max_n:
            raise InvalidRequestError(
                f"n={params.n} is more choices than this engine allows (max_n={self.config.max_n})",
                param="n",
            )
        if params.structured is not None:
            if not hasattr(self.tokenizer, "backend"):
                raise InvalidRequestError("structured output needs the model's own tokenizer")
            if params.structured.kind == "json_schema":
                check_enforced(json.loads(params.structured.spec), "structured")
        return ids, params

    def accept_embedding(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> tuple[TokenIds, SamplingParams]:
        """An embedding request's token ids (not empty, and within the context: it needs no
        room to generate) and the parameters it runs with: of ``params`` only what schedules
        it and keys its cache (priority, timeout, tenant, cache_salt), its adapter, its
        ``add_special_tokens`` and its ``truncate_prompt_tokens``."""
        given = params if params is not None else SamplingParams()
        if not isinstance(given, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(given).__name__}")
        given.validate()
        given = self._keyed_lora(given)
        params = SamplingParams(
            max_new_tokens=1,
            priority=given.priority,
            timeout=given.timeout,
            tenant=given.tenant,
            cache_salt=given.cache_salt,
            lora=given.lora,
            truncate_prompt_tokens=given.truncate_prompt_tokens,
        )
        ids = self.tokenize(prompt, given.add_special_tokens)
        ids = self.truncate(ids, given.truncate_prompt_tokens)
        if not ids:
            raise InvalidRequestError("input is empty after tokenization", param="input")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"the input has {len(ids)} tokens but the context is {self.max_model_len} "
                "tokens (max_model_len)",
                param="input",
                code=CONTEXT_EXCEEDED,
            )
        return ids, params

    def _keyed_lora(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its adapter's name as the key of the adapter's current load (a copy
        where they differ: the caller's object is left as it is); UnknownAdapterError for an
        adapter not served."""
        if params.lora is None:
            return params
        key = self.lora_keys.get(params.lora)
        if key is None:
            raise UnknownAdapterError(params.lora, sorted(self.lora_keys))
        return params if key == params.lora else dataclasses.replace(params, lora=key)

    def _room(self, prompt_tokens: int, scoring_only: bool = False) -> int:
        """Tokens the context leaves after the prompt (at least 1, else refused; 0 will do for
        a request that only scores its prompt: a whole context window, as lm-eval sends)."""
        if prompt_tokens == 0:
            raise InvalidRequestError("prompt is empty after tokenization")
        room = self.max_model_len - prompt_tokens
        if room < (0 if scoring_only else 1):
            raise InvalidRequestError(
                f"the prompt has {prompt_tokens} tokens but the context is {self.max_model_len} "
                "tokens (max_model_len), leaving no room to generate",
                code=CONTEXT_EXCEEDED,
            )
        return room


def logprob_entries(prompt_tokens: int, params: SamplingParams) -> int:
    """The logprobs a request asks for: each scored prompt position and (with ``logprobs``)
    each generated one gives the chosen token's and its alternatives', for each of n choices."""
    entries = 0
    if params.prompt_logprobs is not None:
        scored = max(0, prompt_tokens - max(1, params.prompt_logprobs_start))
        entries += scored * (params.prompt_logprobs + 1)
    if params.logprobs:
        entries += params.max_new_tokens * (params.top_logprobs + 1)
    return entries * params.n
