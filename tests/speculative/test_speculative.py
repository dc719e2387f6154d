"""Speculative decoding on the core side: settings, the n-gram proposer, acceptance, and whole
steps over the model-free executor (which verifies guesses exactly as the runner does): outputs
equal decoding one token per step, rejected slots go back at once (the KV invariant after every
step), and stops, aborts, retraction and n > 1 choices hold for a speculating request."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.engine_core import EngineCore
from asyncengine.speculative.acceptance import accepted_prefix
from asyncengine.speculative.ngram import NgramProposer
from asyncengine.speculative.rules import adaptive_guesses
from asyncengine.speculative.settings import parse_speculative
from tests.fake_executor import StopStringAt, fake_core, reference_output
from tests.scheduler.test_scheduler import Clock

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "rule": "fixed"}


# -- settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"method": "medusa"}, "speculative.method"),
        ({"num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative.prompt_lookup_max"),
        ({"rule": "sometimes"}, "speculative.rule"),
        ({"lookahead": 3}, "unknown key(s) ['lookahead']"),
    ],
)
def test_a_bad_speculative_value_is_a_config_error_naming_the_key(
    values: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError, match="speculative") as info:
        EngineConfig(speculative=values)
    assert key in str(info.value)


def test_settings_defaults_and_toml(tmp_path: object) -> None:
    config = EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculation == parse_speculative({"num_speculative_tokens": 3})
    assert config.speculation is not None and config.speculation.prompt_lookup_min == 2
    assert EngineConfig().speculation is None


# -- proposer and acceptance ------------------------------------------------------------------
def test_ngram_proposer_copies_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] (n = 3) occurred at 0..2, followed by 4, 5, 9
    assert proposer.propose(tokens, 3) == [4, 5, 9]
    tokens += [6, 2, 3]
    # [6, 2, 3] never occurred; [2, 3] latest at 11..12 (followed by 6, 2, 3)
    assert proposer.propose(tokens, 2) == [6, 2]
    assert proposer.propose(tokens, 5) == [6, 2, 3, 6, 2]  # the period repeats
    assert proposer.propose([*tokens, 42], 4) == []  # [3, 42] and [42] never occurred


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_ngram_proposer_matches_a_brute_force_search(tokens: list[int], k: int) -> None:
    incremental = NgramProposer(1, 3)
    for cut in range(0, len(tokens), 7):  # indexed in pieces, as tokens land
        incremental.propose(tokens[:cut], k)
    expected: list[int] = []
    for n in range(3, 0, -1):
        if len(tokens) < n:
            continue
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == tokens[len(tokens) - n :]]
        if ends:
            extended = list(tokens)
            for i in range(ends[-1], ends[-1] + k):
                extended.append(extended[i])
            expected = extended[len(tokens) :]
            break
    assert incremental.propose(tokens, k) == expected


def test_accepted_prefix() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_prefix([5], [4, 5]) == 0
    assert accepted_prefix([], [4]) == 0
    with pytest.raises(ValueError):
        accepted_prefix([1, 2], [1, 2])


def test_adaptive_rule_shrinks_with_rejections_and_batch_size() -> None:
    spec = parse_speculative({"num_speculative_tokens": 4, "max_verify_tokens": 64})
    req = Request("r", [1, 2, 3], SamplingParams(max_new_tokens=100), 0.0)
    assert adaptive_guesses(spec, req, 1) >= 3  # optimistic prior
    req.proposed_guesses, req.accepted_guesses = 400, 396
    assert adaptive_guesses(spec, req, 1) == 4
    assert adaptive_guesses(spec, req, 16) == 3  # 16 rows x 4 tokens fill the 64 verified
    assert adaptive_guesses(spec, req, 64) == 0  # compute bound: no speculation
    req.proposed_guesses, req.accepted_guesses = 400, 20
    req.output_ids = [7]
    assert adaptive_guesses(spec, req, 1) == 0
    req.output_ids = [7] * 16
    assert adaptive_guesses(spec, req, 1) == 1  # a probe now and then


# -- whole steps over the model-free executor -------------------------------------------------
class OracleProposer:
    """Guesses the fake model's true continuation, wrong where ``errors`` says (cycled)."""

    def __init__(self, full: list[int], errors: list[int]) -> None:
        self.full = full  # prompt + reference output
        self.errors = errors or [0]
        self.calls = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        assert list(tokens) == self.full[: len(tokens)], "the request's tokens left the reference"
        self.calls += 1
        error = self.errors[self.calls % len(self.errors)]
        guesses = self.full[len(tokens) : len(tokens) + k]
        if 0 < error <= len(guesses):  # wrong from guess ``error`` on
            guesses[error - 1] = (guesses[error - 1] % 900) + 50
        return guesses


def make(num_pages: int = 64, page_size: int = 4, **overrides: object) -> tuple[EngineCore, Clock]:
    clock = Clock()
    overrides.setdefault("speculative", NGRAM)
    core, _ = fake_core(num_pages, page_size, 1024, clock, **overrides)
    core.step_hooks.append(lambda plan: core.check_invariant())
    return core, clock


def add(
    core: EngineCore,
    clock: Clock,
    rid: str,
    prompt: list[int],
    n: int,
    errors: list[int],
    **params: object,
) -> Request:
    req = Request(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0, **params), clock())  # type: ignore[arg-type]
    req.proposer = OracleProposer(prompt + reference_output(prompt, n + 20), errors)
    core.add(req)
    return req


def run(core: EngineCore, clock: Clock) -> list[int]:
    """Steps until idle; the number of tokens each step gave."""
    per_step = []
    while core.has_work():
        events = core.step()
        assert events is not None
        clock.t += events.forward_seconds
        per_step.append(len(events.tokens))
    return per_step


@given(
    st.lists(st.lists(st.integers(0, 5), max_size=6), min_size=1, max_size=4), st.integers(1, 40)
)
@settings(max_examples=40, deadline=None)
def test_outputs_equal_one_token_steps_and_kv_holds_after_every_step(
    errors: list[list[int]], n: int
) -> None:
    core, clock = make()
    prompts = [[3 + i, 4, 5 + i, 6, 7] * (i + 1) for i in range(len(errors))]
    reqs = [
        add(core, clock, f"r{i}", p, n + i, e)
        for i, (p, e) in enumerate(zip(prompts, errors, strict=True))
    ]
    run(core, clock)
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output_ids == reference_output(prompt, len(req.output_ids))
        assert len(req.output_ids) == req.params.max_new_tokens and req.finish_reason == "length"
        assert req.accepted_guesses <= req.proposed_guesses
    stats = core.stats()
    assert stats["pages_used"] == 0  # every slot, rejected guesses' too, came back
    assert stats["generated_tokens"] == sum(len(r.output_ids) for r in reqs)


def test_right_guesses_give_several_tokens_a_step() -> None:
    core, clock = make()
    req = add(core, clock, "r", [1, 2, 3, 4, 5], 21, [0])
    per_step = run(core, clock)
    assert req.output_ids == reference_output([1, 2, 3, 4, 5], 21)
    assert per_step == [1, 5, 5, 5, 5]  # the prefill's token, then 4 guesses + 1 per step
    assert req.accepted_guesses == req.proposed_guesses == 16
    stats = core.stats()
    assert stats["spec_accepted_tokens"] == 16 and stats["spec_steps"] == 4


def test_a_stop_token_inside_accepted_guesses_ends_the_request_there() -> None:
    core, clock = make()
    prompt = [1, 2, 3, 4, 5]
    expected = reference_output(prompt, 30)
    req = add(core, clock, "r", prompt, 30, [0], stop_token_ids=[expected[6]])
    run(core, clock)
    assert req.output_ids == expected[:7]
    assert req.finish_reason == "stop" and req.matched_stop == expected[6]
    # the prefill's token, 4 guesses + 1 sampled, then 1 guess kept of the last step's 4
    assert req.accepted_guesses == 5
    assert core.stats()["pages_used"] == 0


def test_a_stop_string_inside_accepted_guesses_ends_the_request_there() -> None:
    core, clock = make()
    prompt = [1, 2, 3, 4, 5]
    req = add(core, clock, "r", prompt, 30, [0])
    req.text = StopStringAt(8)
    events = []
    while core.has_work():
        step = core.step()
        assert step is not None
        events += [ev for ev in step.tokens if ev.req is req]
    assert req.output_ids == reference_output(prompt, 8)
    assert req.finish_reason == "stop" and req.matched_stop == "END"
    assert [ev.token_id for ev in events] == req.output_ids  # the rest never reach a stream
    assert events[-1].finished
    assert req.accepted_guesses == 6  # 4 + 1 sampled, then 2 guesses kept: none dropped counted


def test_aborting_a_speculating_request_while_its_step_runs() -> None:
    core, clock = make()
    req = add(core, clock, "r", [1, 2, 3, 4, 5], 40, [2])
    other = add(core, clock, "o", [9, 8, 7, 6, 5], 20, [0])
    for _ in range(3):
        core.step()
    plan = core.launch()
    assert plan is not None and plan.num_guesses > 0
    output = core.executor.execute(plan)
    assert core.abort("r")
    core.land(plan, output)
    core.check_invariant()
    assert req.finish_reason == "abort"
    run(core, clock)
    assert other.output_ids == reference_output([9, 8, 7, 6, 5], 20)
    assert core.stats()["pages_used"] == 0


def test_retracted_speculating_requests_recompute_and_match() -> None:
    # few pages: guesses are dropped first, then requests are retracted and recomputed
    core, clock = make(num_pages=24, init_new_token_ratio=0.1, min_new_token_ratio=0.1)
    prompts = [[10 + i, 11, 12, 13, 14, 15, 16] for i in range(5)]
    reqs = [add(core, clock, f"r{i}", p, 14, [0, 3]) for i, p in enumerate(prompts)]
    run(core, clock)
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output_ids == reference_output(prompt, 14)
    assert core.stats()["retractions"] >= 1


def test_n_choices_each_speculate_on_their_own() -> None:
    core, clock = make()
    prompt = [4, 5, 6, 7, 8, 9]
    full = prompt + reference_output(prompt, 40)
    leader = Request("c0", prompt, SamplingParams(max_new_tokens=12, temperature=0), clock())
    follower = Request("c1", prompt, SamplingParams(max_new_tokens=12, temperature=0), clock())
    leader.proposer = OracleProposer(full, [0])
    follower.proposer = OracleProposer(full, [1, 0])
    core.add(leader, [follower])
    run(core, clock)
    assert leader.output_ids == follower.output_ids == reference_output(prompt, 12)
    assert leader.accepted_guesses == leader.proposed_guesses > 0
    assert 0 < follower.accepted_guesses < follower.proposed_guesses


def test_guesses_never_pass_max_new_tokens_or_the_token_budget() -> None:
    core, clock = make()
    req = add(core, clock, "r", [1, 2, 3], 3, [0])
    plans = []
    core.step_hooks.append(plans.append)
    run(core, clock)
    assert req.output_ids == reference_output([1, 2, 3], 3)
    assert max(plan.num_guesses for plan in plans) == 1  # after the first token: 1 guess + 1


def test_the_ngram_proposer_runs_by_default_and_speculation_off_changes_nothing() -> None:
    prompt = [7, 8, 9, 10, 11, 12] * 3
    outputs = []
    for spec in (None, NGRAM):
        core, clock = make(speculative=spec)
        req = Request("r", prompt, SamplingParams(max_new_tokens=20, temperature=0), clock())
        core.add(req)
        run(core, clock)
        outputs.append(req.output_ids)
        assert isinstance(req.proposer, NgramProposer) == (spec is not None)
    assert outputs[0] == outputs[1] == reference_output(prompt, 20)
