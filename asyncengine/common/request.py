"""Request: one generation's state while the engine holds it."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from asyncengine.common.cache_salt import salted_ids
from asyncengine.common.plan import TokenLogprobs
from asyncengine.common.pooling import PooledEmbedding
from asyncengine.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncengine.cache.manager import SeqKV


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or retracted and waiting to be recomputed
    PREFILLING = "prefilling"  # admitted; prompt chunks still to compute
    RUNNING = "running"  # decoding
    FINISHED = "finished"


def choice_rid(rid: str, n: int, index: int) -> str:
    """The engine-side id of choice ``index`` of a caller's request ``rid`` with ``n`` choices."""
    return rid if n == 1 else f"{rid}-{index}"


class Grammar(Protocol):
    """A structured-output request's grammar state (asyncengine/structured/grammar.py)."""

    def next_bitmask(self) -> object:
        """The tokens allowed next, as the sampler takes them (SamplingInfo.token_bitmask)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False when the grammar does not allow it."""
        ...

    def allows_nothing(self) -> bool:
        """No token may come next and the grammar is not complete: a dead end."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and took its end token."""
        ...

    def too_slow(self) -> bool:
        """A step of the grammar (a mask, a token) took more than its time limit: the next
        would cost more still, so the request ends."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a verified row's guesses)."""
        ...


class Proposer(Protocol):
    """Guesses a request's next tokens from its tokens so far (speculative/ngram.py)."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]: ...


class OutputText(Protocol):
    """A request's output text, detokenized as its tokens land (asyncengine/text/output_text.py)."""

    def push(self, token_id: int, may_stop: bool = True) -> str | None:
        """Take one sampled token; return the stop string it completed, if any (none while
        ``may_stop`` is False)."""
        ...


@dataclass(slots=True, eq=False)
class Request:
    """Token-level state of one request. The scheduler owns it; the engine reads it.

    ``all_ids`` (prompt then output) is what the KV cache holds, keyed as ``cache_ids``; ``seq``
    is the request's KV handle while it is admitted (None while waiting): ``seq.computed_len``
    tokens of ``all_ids`` have their KV written, ``seq.kv_len`` have slots (those of the step in
    flight too).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    seq: SeqKV | None = None  # the KV handle while admitted
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout" (lifecycle.py)
    matched_stop: str | int | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    retractions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    grammar: Grammar | None = None  # structured output: masks each token, advanced at land
    text: OutputText | None = None  # detokenized output and its stop strings (None: no text)
    # an embedding request (pooling.py): prefill only, pooled, ends when its prompt is computed
    embedding: PooledEmbedding | None = None
    # logprobs of the prompt tokens scored so far (SamplingParams.prompt_logprobs), in order
    # from the first scored position on (asyncengine/scheduler/prompt_scoring.py)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # scores of the step in flight that another segment computes for it (plan.SharedScores):
    # counted as done when planning, appended at commit
    borrowed_scores: int = 0
    # steps this request waited, by the reason admission stopped short of it (admission.py);
    # kept up to date lazily: read it through Scheduler.blocked(req), or once the request ended
    blocked: dict[str, int] = field(default_factory=dict)
    # speculative decoding: its proposer (speculative/ngram.py), guesses verified and accepted
    proposer: Proposer | None = None
    proposed_guesses: int = 0
    accepted_guesses: int = 0
    # the prompt as the prefix cache keys it under the request's cache_salt (cache_salt.py);
    # None: the prompt itself (no salt)
    cache_prompt: list[int] | None = None
    # ``cache_ids`` of a request with output, joined once and kept while its output stays as
    # it is: a request waiting after a retraction is read every step, its context whole
    joined_cache_ids: list[int] | None = None

    # Written out because mypyc compiles this class (every request makes one) and leaves a
    # dataclass-made __init__ interpreted; tests/test_compiled.py checks it against the fields.
    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        output_ids: list[int] | None = None,
        status: RequestStatus = RequestStatus.WAITING,
        seq: SeqKV | None = None,
        finish_reason: str | None = None,
        matched_stop: str | int | None = None,
        cached_tokens: int = 0,
        retractions: int = 0,
        first_scheduled_time: float | None = None,
        first_token_time: float | None = None,
        finished_time: float | None = None,
        token_times: list[float] | None = None,
        grammar: Grammar | None = None,
        text: OutputText | None = None,
        embedding: PooledEmbedding | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
        borrowed_scores: int = 0,
        blocked: dict[str, int] | None = None,
        proposer: Proposer | None = None,
        proposed_guesses: int = 0,
        accepted_guesses: int = 0,
        cache_prompt: list[int] | None = None,
        joined_cache_ids: list[int] | None = None,
    ) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival_time = arrival_time
        self.output_ids = [] if output_ids is None else output_ids
        self.status = status
        self.seq = seq
        self.finish_reason = finish_reason
        self.matched_stop = matched_stop
        self.cached_tokens = cached_tokens
        self.retractions = retractions
        self.first_scheduled_time = first_scheduled_time
        self.first_token_time = first_token_time
        self.finished_time = finished_time
        self.token_times = [] if token_times is None else token_times
        self.grammar = grammar
        self.text = text
        self.embedding = embedding
        self.prompt_logprobs = [] if prompt_logprobs is None else prompt_logprobs
        self.borrowed_scores = borrowed_scores
        self.blocked = {} if blocked is None else blocked
        self.proposer = proposer
        self.proposed_guesses = proposed_guesses
        self.accepted_guesses = accepted_guesses
        if cache_prompt is None and (params.cache_salt is not None or params.lora is not None):
            cache_prompt = salted_ids(prompt_ids, params.cache_salt, params.lora)
        self.cache_prompt = cache_prompt
        self.joined_cache_ids = joined_cache_ids

    @property
    def lora(self) -> str | None:
        """The LoRA adapter it runs under (None: the base model). Read-only."""
        return self.params.lora

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output. Read-only: it may be ``prompt_ids`` itself, else it is a copy of
        the whole context (code run every step reads ``JoinedIds`` instead)."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def cache_prompt_ids(self) -> list[int]:
        """The prompt as the prefix cache keys it: ``prompt_ids`` unless the request is salted."""
        return self.prompt_ids if self.cache_prompt is None else self.cache_prompt

    @property
    def cache_ids(self) -> list[int]:
        """``all_ids`` as the prefix cache keys them (salted: cache_salt.py). Read-only: it is
        the prompt itself, or one list joined per output length (an output only grows while
        its request lives; it is cut only as the request ends)."""
        prompt = self.prompt_ids if self.cache_prompt is None else self.cache_prompt
        output = self.output_ids
        if not output:
            return prompt
        joined = self.joined_cache_ids
        if joined is None or len(joined) != len(prompt) + len(output):
            joined = prompt + output
            self.joined_cache_ids = joined
        return joined

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv(self) -> SeqKV:
        """The KV handle of an admitted request (an error while it waits)."""
        if self.seq is None:
            raise RuntimeError(f"request {self.rid} holds no KV (status {self.status.value})")
        return self.seq

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is written (0 while it waits)."""
        return 0 if self.seq is None else self.seq.computed_len

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def prefill_only(self) -> bool:
        """It ends when its prompt is computed: no token is sampled, no decode slot needed (an
        embedding, or a request that only scores its prompt: max_new_tokens 0)."""
        return self.embedding is not None or self.params.max_new_tokens == 0

    def future_tokens(self, max_model_len: int) -> int:
        """Tokens it may still generate: its budget, capped by the context length."""
        if self.prefill_only:
            return 0
        out = len(self.output_ids)
        return max(
            0, min(self.params.max_new_tokens - out, max_model_len - len(self.prompt_ids) - out)
        )

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def mark_finished(self, reason: str, matched: str | int | None, now: float) -> None:
        """Record the end (the lifecycle decides it; the scheduler releases the KV)."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.matched_stop = matched
        self.finished_time = now
        self.joined_cache_ids = None  # nothing reads its whole context every step any more
