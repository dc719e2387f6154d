"""BatchPlan: the only thing that crosses from the scheduler to the executor. Plain data.

A plan is self-contained: besides the tokens to compute it carries every page-table write made
since the previous plan (``page_writes``), so the executor keeps its own page table and nothing
but plans and step outputs is shared between the loop thread and the forward thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.common.sampling_params import SamplingParams


@dataclass(slots=True)
class Segment:
    """One request's share of a forward pass.

    ``input_ids`` are the tokens whose KV is computed now; they sit at positions
    ``start_pos .. start_pos + len(input_ids) - 1``. Tokens before ``start_pos`` are already in
    the KV pool (cached prefix and earlier chunks), reachable through page-table row
    ``row``. The pages covering every position up to the segment's end are allocated
    before the plan is emitted, and written into that row by this plan's ``page_writes`` or an
    earlier plan's.
    """

    rid: str
    row: int
    input_ids: list[int]
    start_pos: int
    sample: bool  # sample a token after the last input token (last prefill chunk, decode)
    # an embedding request's chunk (pooling.py): the executor returns the "sum" of the
    # segment's final hidden states or its "last" one, in StepOutput.pooled
    pool: str | None = None
    scoring: PromptScoring | None = None  # prompt logprobs this segment computes
    # speculative decoding: the last ``guesses`` input tokens are guessed, not sampled; the
    # executor verifies them (a token sampled at each of the last guesses + 1 positions) and
    # says in StepOutput.accepted how many the row keeps
    guesses: int = 0
    # speculative decoding by a draft model: the executor's draft model guesses up to
    # ``draft`` tokens after ``input_ids`` and verifies them in this forward (KV slots for all
    # of them are allocated); StepOutput.drafted says which it guessed
    draft: int = 0
    lora: str | None = None  # the LoRA adapter the segment's tokens run under (None: the base)

    # Written out because mypyc compiles this class (a row of every step) and leaves a
    # dataclass-made __init__ interpreted; tests/test_compiled.py checks it against the fields.
    def __init__(
        self,
        rid: str,
        row: int,
        input_ids: list[int],
        start_pos: int,
        sample: bool,
        pool: str | None = None,
        scoring: PromptScoring | None = None,
        guesses: int = 0,
        draft: int = 0,
        lora: str | None = None,
    ) -> None:
        self.rid = rid
        self.row = row
        self.input_ids = input_ids
        self.start_pos = start_pos
        self.sample = sample
        self.pool = pool
        self.scoring = scoring
        self.guesses = guesses
        self.draft = draft
        self.lora = lora

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.input_ids)


@dataclass(frozen=True, slots=True)
class SharedScores:
    """Prompt scores a request takes from another segment of the same plan, which computes
    them: ``count`` of that segment's scores from index ``offset`` (StepOutput.prompt_logprobs),
    put before the request's own."""

    source: str  # the rid of the segment that scores them
    offset: int
    count: int


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """Prompt logprobs a segment computes: the logits after the token at position ``first``
    (the segment's own positions only) and at the ``len(target_ids) - 1`` positions after it,
    each scoring the prompt token that follows it (``target_ids``), with the ``top_k`` most
    likely tokens. Made by ``asyncengine/scheduler/prompt_scoring.py``; answered, one list per scoring
    segment, in ``StepOutput.prompt_logprobs``.

    ``lead``: position ``first`` is the one before the segment's own, whose KV the segment
    copied from another segment of the plan (step_shares.py): the logits there are that
    segment's (its rid), the same ones, since they depend on the tokens up to ``first`` alone;
    only the target differs (the choice of a multiple-choice question that goes on there)."""

    first: int
    target_ids: list[int]
    top_k: int
    lead: str | None = None

    @property
    def num_positions(self) -> int:
        return len(self.target_ids)


@dataclass(frozen=True, slots=True)
class PageWrite:
    """Page ids for entries ``start .. start + len(pages) - 1`` of page-table row ``row``."""

    row: int
    start: int
    pages: list[int]


@dataclass(frozen=True, slots=True)
class SwapCopy:
    """Whole KV pages copied between the pool and the host swap buffer (``preemption_mode =
    "swap"``): pool page ``pool_pages[i]`` <-> host page ``host_pages[i]``, every layer."""

    pool_pages: list[int]
    host_pages: list[int]


@dataclass(slots=True)
class SamplingInfo:
    """What the sampler needs for one sampled segment."""

    params: SamplingParams
    prompt_ids: list[int]  # for the repetition penalty
    output_ids: list[int]  # tokens generated so far (presence/frequency penalties, seed step)
    # Structured output: the tokens its grammar allows next, one bit per token id (bit i of
    # word j: token 32 * j + i), as the grammar made it (an int32 tensor on the device side).
    token_bitmask: object | None = None
    # a verified row (Segment.guesses > 0) with a grammar: the mask after each guess, as if
    # the guesses before it were accepted (a guess its grammar refuses ends the list: every
    # later position is unreachable and takes the last mask)
    guess_bitmasks: list[object] | None = None
    # a verified row's guesses before its position: its output is output_ids + guessed_ids,
    # output_ids staying the request's own list (the sampler keeps penalty state by it)
    guessed_ids: list[int] = field(default_factory=list)

    def output_len(self) -> int:
        """How many tokens the row's output holds (its guesses included)."""
        return len(self.output_ids) + len(self.guessed_ids)

    def output_tail(self, n: int) -> list[int]:
        """The last ``n`` tokens of the row's output (its guesses included)."""
        if n <= 0:
            return []
        return [*self.output_ids[-n:], *self.guessed_ids][-n:]


@dataclass(slots=True)
class BatchPlan:
    """One forward: extend segments (prefill chunks), then decode segments (one token each).

    ``sampling`` has one entry per segment with ``sample=True``, in the order extends then
    decodes, and the executor returns one sampled token per entry in that order.
    ``page_writes`` are applied, in order, to the executor's page table before the forward.
    """

    step: int
    extends: list[Segment] = field(default_factory=list)
    decodes: list[Segment] = field(default_factory=list)
    sampling: list[SamplingInfo] = field(default_factory=list)
    page_writes: list[PageWrite] = field(default_factory=list)
    # preempted requests' KV copied out to the host buffer, then swapped-in requests' KV
    # copied back, in that order, before the page writes and the forward
    swap_out: list[SwapCopy] = field(default_factory=list)
    swap_in: list[SwapCopy] = field(default_factory=list)
    # (source, destination) KV pages copied whole, after the swaps and before the forward: a
    # kept tail page copied on write into a sequence's own page (cache/tail_pages.py)
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    # (source, destination) KV slots copied in every layer after it stores the forward's K/V
    # and before it attends: positions a prompt shares with another prompt of this forward
    # that computes (or holds) them, instead of computing them again (step_shares.py)
    kv_copies: list[tuple[int, int]] = field(default_factory=list)
    # rid -> the prompt scores it takes from other segments of this plan, in position order,
    # before its own (step_shares.py)
    shared_scores: dict[str, list[SharedScores]] = field(default_factory=dict)
    # page-table rows released since the previous plan (their sequences ended, or were
    # retracted): what an executor keeps per row of its own (a draft model's KV) goes
    released_rows: list[int] = field(default_factory=list)
    # indexes into ``decodes`` whose one input token is the token the previous plan sampled
    # for the same page-table row, not yet known to the host when this plan was made (overlap
    # scheduling): the executor takes it from its own last sampled tokens (input_ids hold -1)
    deferred: list[int] = field(default_factory=list)

    # Written out because mypyc compiles this class (every step makes one) and leaves a
    # dataclass-made __init__ interpreted; tests/test_compiled.py checks it against the fields.
    def __init__(
        self,
        step: int,
        extends: list[Segment] | None = None,
        decodes: list[Segment] | None = None,
        sampling: list[SamplingInfo] | None = None,
        page_writes: list[PageWrite] | None = None,
        swap_out: list[SwapCopy] | None = None,
        swap_in: list[SwapCopy] | None = None,
        page_copies: list[tuple[int, int]] | None = None,
        kv_copies: list[tuple[int, int]] | None = None,
        shared_scores: dict[str, list[SharedScores]] | None = None,
        released_rows: list[int] | None = None,
        deferred: list[int] | None = None,
    ) -> None:
        self.step = step
        self.extends = [] if extends is None else extends
        self.decodes = [] if decodes is None else decodes
        self.sampling = [] if sampling is None else sampling
        self.page_writes = [] if page_writes is None else page_writes
        self.swap_out = [] if swap_out is None else swap_out
        self.swap_in = [] if swap_in is None else swap_in
        self.page_copies = [] if page_copies is None else page_copies
        self.kv_copies = [] if kv_copies is None else kv_copies
        self.shared_scores = {} if shared_scores is None else shared_scores
        self.released_rows = [] if released_rows is None else released_rows
        self.deferred = [] if deferred is None else deferred

    @property
    def segments(self) -> list[Segment]:
        return self.extends + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.extends) + sum(s.num_tokens for s in self.decodes)

    @property
    def num_guesses(self) -> int:
        """Guessed tokens the plan verifies (speculative decoding)."""
        return sum(s.guesses for s in self.decodes)

    @property
    def num_drafts(self) -> int:
        """Tokens the executor's draft model may guess for the plan (speculative decoding)."""
        return sum(s.draft for s in self.decodes)

    @property
    def pooled_segments(self) -> list[Segment]:
        return [s for s in self.extends if s.pool is not None]

    @property
    def scoring_segments(self) -> list[Segment]:
        """The segments that compute prompt logprobs, in plan order."""
        return [s for s in self.segments if s.scoring is not None]

    def is_empty(self) -> bool:
        return not self.extends and not self.decodes


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (token id, logprob)."""

    token_logprob: float
    top: list[tuple[int, float]]
    # the token's rank in the vocabulary (1: none is more likely), as vLLM's prompt_logprobs
    # give it: prompt scoring fills it (executor/prompt_logprobs.py), sampling does not
    rank: int | None = None


@dataclass(slots=True)
class StepOutput:
    """The executor's answer to a BatchPlan: one entry per sampled segment, plan order.

    A verified row (``Segment.guesses``) keeps its first ``accepted[i]`` guesses, then
    ``token_ids[i]``; ``accepted_logprobs[i]`` are the kept guesses' logprobs (when asked).
    ``accepted`` empty: no row kept a guess. A drafted row (``Segment.draft``) has its
    guesses in ``drafted[i]`` (one list per sampled segment; empty: the plan drafted nothing).
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    forward_seconds: float = 0.0
    pooled: list[list[float]] = field(default_factory=list)  # one per segment with a pool
    # one list per segment with ``scoring`` (plan order): the scored prompt tokens' logprobs
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    accepted_logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)
    drafted: list[list[int]] = field(default_factory=list)
    swap_seconds: float = 0.0  # of which copying the plan's swaps (preemption_mode "swap")

    # Written out because mypyc compiles this class (every step makes one) and leaves a
    # dataclass-made __init__ interpreted; tests/test_compiled.py checks it against the fields.
    def __init__(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
        forward_seconds: float = 0.0,
        pooled: list[list[float]] | None = None,
        prompt_logprobs: list[list[TokenLogprobs]] | None = None,
        accepted: list[int] | None = None,
        accepted_logprobs: list[list[TokenLogprobs | None]] | None = None,
        drafted: list[list[int]] | None = None,
        swap_seconds: float = 0.0,
    ) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.forward_seconds = forward_seconds
        self.pooled = [] if pooled is None else pooled
        self.prompt_logprobs = [] if prompt_logprobs is None else prompt_logprobs
        self.accepted = [] if accepted is None else accepted
        self.accepted_logprobs = [] if accepted_logprobs is None else accepted_logprobs
        self.drafted = [] if drafted is None else drafted
        self.swap_seconds = swap_seconds


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What a step costs depends on: the cost model's inputs (sim/cost_model.py), and what a
    live trace records of each step (workloads/trace_recorder.py)."""

    prefill_tokens: int = 0
    prefill_attention: int = 0
    decode_requests: int = 0
    decode_context: int = 0

    @classmethod
    def of_plan(cls, plan: BatchPlan) -> StepFeatures:
        prefill_tokens = prefill_attention = 0
        for segment in plan.extends:
            n = segment.num_tokens
            prefill_tokens += n
            # query i (0-based) of the segment attends to start_pos + i + 1 keys
            prefill_attention += n * segment.start_pos + n * (n + 1) // 2
        return cls(
            prefill_tokens=prefill_tokens,
            prefill_attention=prefill_attention,
            decode_requests=len(plan.decodes),
            decode_context=sum(segment.end_pos for segment in plan.decodes),
        )

    def as_row(self) -> list[float]:
        return [
            1.0,
            float(self.prefill_tokens),
            float(self.prefill_attention),
            float(self.decode_requests),
            float(self.decode_context),
        ]
