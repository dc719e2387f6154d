"""Per-request sampling parameters and their validation."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_PRIORITY = 2**31 - 1
MAX_TENANT_LENGTH = 256
MAX_CACHE_SALT_LENGTH = 256
MAX_LORA_NAME_LENGTH = 256
LORA_NAME_RULE = f"1 to {MAX_LORA_NAME_LENGTH} printable characters without '/'"


def is_lora_name(name: object) -> bool:
    """An adapter name a request can select: no '/' (a reload's key is ``name/2``), no line
    breaks or control characters (names are written to the log), within the requests' limit."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= MAX_LORA_NAME_LENGTH
        and "/" not in name
        and name.isprintable()
    )


class InvalidRequestError(ValueError):
    """A request the engine refuses before queueing it (bad parameter, prompt too long, ...):
    ``param`` names the request field at fault, ``code`` the API's error code, when known."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


MAX_STOP_STRINGS = 16
# Characters per stop string: the matcher's automaton and the text held back grow with it.
MAX_STOP_STRING_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024
# Tokens of all bad words together (each row's output is checked against them every step)
MAX_BAD_WORD_TOKENS = 2048
MAX_BAD_WORDS_CHARS = 4096  # characters of all bad_words together, tokenized on the loop
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # alternatives per position, generated or prompt tokens


def _short_repr(value: object) -> str:
    """The value for an error message; a long list is named by its length, not spelled out."""
    if isinstance(value, list) and len(value) > 4:
        return f"<a list of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= 120 else text[:120] + "..."


# Temperatures below this sample greedily (as vLLM does): dividing float32 logits by a smaller
# one overflows (below ~1e-38 it is 0 in float32) and the sampler would draw from NaN.
GREEDY_TEMPERATURE = 1e-5
# Far above any useful temperature (at 100 sampling is already near uniform), far below float32's
# range: the sampler's 1 / temperature must not round to 0 (-inf * 0 is NaN).
MAX_TEMPERATURE = 1e6

# longest schema / regular expression / grammar a request may give: xgrammar's compile time
# grows with it, and a compile holds a worker (structured/grammar.py bounds it in time too)
MAX_GRAMMAR_CHARS = 65536
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the whole output: ``kind`` is one of CONSTRAINT_KINDS; ``spec`` is the
    JSON schema (as JSON text), the regular expression, the EBNF grammar or xgrammar's structural
    tag as JSON text (tool calls: structured/tool_grammar.py; "" for json_object).
    The grammar is compiled by the engine; a spec it cannot compile is refused there, the 400
    naming ``param``: the request field the constraint came from (not part of its identity:
    equal specs share one compiled grammar whichever field gave them). ``parts``: the specs
    of several fields that this one combines (tool calls: each tool's schema), each with its
    own ``param``; when it does not compile, the first part that does not compile alone is
    the one named."""

    kind: str
    spec: str = ""
    param: str | None = field(default=None, compare=False)
    parts: tuple[StructuredOutput, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(
                f"invalid structured output kind {self.kind!r}: expected one of "
                f"{', '.join(CONSTRAINT_KINDS)}"
            )
        if not isinstance(self.spec, str):
            raise InvalidRequestError(f"the {self.kind} constraint must be given as a string")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                f"the {self.kind} constraint is {len(self.spec)} characters long; at most "
                f"{MAX_GRAMMAR_CHARS} are allowed",
                code="grammar_too_long",
            )
        if self.kind != "json_object" and not self.spec.strip():
            raise InvalidRequestError(f"the {self.kind} constraint is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("the JSON schema must be a JSON object")

    @classmethod
    def json_schema(
        cls, schema: dict[str, object] | bool | str, param: str | None = None
    ) -> StructuredOutput:
        """From a schema object (or its JSON text), its keys in the order given: that is the
        order the grammar writes an object's properties in, so they are not sorted."""
        if isinstance(schema, str):
            return cls("json_schema", schema, param)
        return cls("json_schema", json.dumps(schema), param)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` (or below ``GREEDY_TEMPERATURE``) means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampled output reproducible whatever else shares the batch.
    ``n`` choices share one prefill of the prompt (the engine caps it at ``max_n``); choice
    ``i > 0`` of a seeded request samples with ``choice_seed(seed, i)``. ``logit_bias`` adds
    to the logits of token ids (OpenAI's -100..100). ``structured`` constrains the output to a
    JSON schema, any JSON, a regular expression or an EBNF grammar.
    ``prompt_logprobs = k`` scores the prompt: the logprob of each prompt token from position
    ``max(1, prompt_logprobs_start)`` on (the first token has no logprob) and the ``k`` most
    likely tokens at each; with it, ``max_new_tokens = 0`` scores the prompt and generates
    nothing.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text ends with the stop string it matched
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's: only these token ids may be sampled (None: any)
    allowed_token_ids: list[int] | None = None
    # vLLM's bad words as token sequences: each one's last token is banned wherever the output
    # ends with the rest of it (a one-token sequence: everywhere)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None  # None: the prompt is not scored
    prompt_logprobs_start: int = 0  # first prompt position scored (SGLang's logprob_start_len)
    # scheduling controls (read by the scheduler and policies, not by the sampler)
    priority: int = 0  # lower values are served first by the "priority" policy (vLLM's sense)
    timeout: float | None = None  # seconds from arrival; then it ends with reason "timeout"
    tenant: str | None = None  # who the request belongs to ("fair" policy, per-tenant metrics)
    # stop_token_ids as a set, for the per-token check (set by validate)
    stop_token_set: frozenset[int] = field(
        default=frozenset(), init=False, repr=False, compare=False
    )
    # requests with different salts share no prefix-cache pages (vLLM's cache_salt); None or
    # "": the shared cache
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter's name (EngineConfig.loras); None: the base model
    # the prompt cut to its last k tokens before it runs (-1: as many as the context holds);
    # checked where it is applied (asyncengine/api/intake.py)
    truncate_prompt_tokens: int | None = None
    # vLLM's: a text prompt gets the special tokens its tokenizer adds (a BOS); token ids and
    # chat messages (their template writes its own) get none whatever it says
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        self._check_types()
        self._check_ranges()
        self._check_stop_strings()
        self._check_scheduling()
        self._check_token_maps()

    def _bad(self, name: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"invalid sampling parameter {name}={_short_repr(getattr(self, name))}: {why}",
            param=name,
        )

    def _check_types(self) -> None:
        bad = self._bad
        for name in (
            "max_new_tokens",
            "top_k",
            "min_new_tokens",
            "top_logprobs",
            "n",
            "prompt_logprobs_start",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "must be an integer")
        for name in (
            "ignore_eos",
            "logprobs",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "add_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):  # "no" would read as true
                raise bad(name, "must be True or False")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise bad(name, "must be a finite number")

    def _check_ranges(self) -> None:
        bad = self._bad
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs_start < 0:
            raise bad("prompt_logprobs_start", "must be >= 0")
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise bad(
                "max_new_tokens",
                "must be >= 1 (0 only with prompt_logprobs: the prompt scored, nothing generated)",
            )
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", "must be between 0 and max_new_tokens")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise bad("seed", "must be an integer or None")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")

    def _check_stop_strings(self) -> None:
        bad = self._bad
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_STRING_LENGTH for s in self.stop):
            longest = max(len(s) for s in self.stop)
            raise bad(
                "stop",
                f"a stop string of {longest} characters is longer than the limit of "
                f"{MAX_STOP_STRING_LENGTH} (MAX_STOP_STRING_LENGTH)",
            )

    def _check_scheduling(self) -> None:
        """priority, timeout, tenant and cache_salt: what the scheduler and the cache key on."""
        bad = self._bad
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise bad("priority", "must be an integer")
        if abs(self.priority) > MAX_PRIORITY:
            raise bad("priority", f"must be between -{MAX_PRIORITY} and {MAX_PRIORITY}")
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise bad("timeout", "must be a positive number of seconds or None")
        if self.tenant is not None and (
            not isinstance(self.tenant, str) or not 0 < len(self.tenant) <= MAX_TENANT_LENGTH
        ):
            raise bad("tenant", f"must be a string of 1 to {MAX_TENANT_LENGTH} characters or None")
        if self.cache_salt == "":
            self.cache_salt = None
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT_LENGTH
        ):
            raise bad(
                "cache_salt", f"must be a string of at most {MAX_CACHE_SALT_LENGTH} characters"
            )

        if self.lora == "":
            self.lora = None
        if self.lora is not None and (  # (the engine's key of a reloaded one adds "/<n>")
            not isinstance(self.lora, str) or len(self.lora) > MAX_LORA_NAME_LENGTH + 16
        ):
            raise bad(
                "lora", f"must be an adapter name of at most {MAX_LORA_NAME_LENGTH} characters"
            )

    def _check_token_maps(self) -> None:
        """stop_token_ids, n, logit_bias and the structured-output constraint."""
        bad = self._bad
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        # each id once: the sampler bans them every step (min_new_tokens), so a list of repeats
        # would cost every step time in proportion to the request's size, not the vocabulary's
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        self.stop_token_set = frozenset(self.stop_token_ids)
        if len(self.stop_token_set) > MAX_STOP_TOKEN_IDS:
            raise bad(
                "stop_token_ids",
                f"{len(self.stop_token_set)} distinct ids is more than the limit of "
                f"{MAX_STOP_TOKEN_IDS} (MAX_STOP_TOKEN_IDS)",
            )
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(_is_token_id(t) for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "must be None or a non-empty list of token ids")
        if self.allowed_token_ids is not None:  # each id once, as stop_token_ids
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if not isinstance(self.bad_words_token_ids, list) or not all(
            isinstance(seq, list) and seq and all(_is_token_id(t) for t in seq)
            for seq in self.bad_words_token_ids
        ):
            raise bad("bad_words_token_ids", "must be a list of non-empty lists of token ids")
        if sum(len(seq) for seq in self.bad_words_token_ids) > MAX_BAD_WORD_TOKENS:
            raise bad("bad_words_token_ids", f"at most {MAX_BAD_WORD_TOKENS} tokens in all")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must be a dict of token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise bad(
                "logit_bias",
                f"{len(self.logit_bias)} entries is more than the limit of "
                f"{MAX_LOGIT_BIAS_ENTRIES} (MAX_LOGIT_BIAS_ENTRIES)",
            )
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise bad("logit_bias", f"key {token!r} is not a non-negative token id")
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
            ):
                raise bad("logit_bias", f"bias {bias!r} of token {token} is not in [-100, 100]")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise bad("structured", "must be a StructuredOutput")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of an n > 1 request seeded with ``seed`` (choice 0 keeps
    it): a splitmix64 step of (seed, index), so choices of nearby seeds do not collide."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1  # 63 bits: a valid seed everywhere
