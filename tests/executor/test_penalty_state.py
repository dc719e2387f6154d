"""Penalty state kept between steps: the same logits as from scratch, and a step's reads bounded
by the tokens its rows gained, whatever their context."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.common.plan import SamplingInfo
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.penalties import PenaltyStates
from asyncengine.executor.sampler import Sampler

VOCAB = 12
TOKENS = st.lists(st.integers(-2, VOCAB + 3), max_size=6)  # some outside the vocabulary
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.5),
    SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25),
    SamplingParams(
        temperature=0, repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.0
    ),
]
CHANGES = ["append", "append", "append", "cut", "new output", "new prompt", "guess"]


def from_scratch(logits: torch.Tensor, rows: list[SamplingInfo]) -> torch.Tensor:
    """The penalised logits, from each row's whole context, one token at a time."""
    out = logits.clone()
    for r, row in enumerate(rows):
        params = row.params
        output = [t for t in row.output_ids + row.guessed_ids if 0 <= t < VOCAB]
        if params.repetition_penalty != 1.0:
            penalty = torch.tensor(params.repetition_penalty, dtype=torch.float32)
            for t in {t for t in row.prompt_ids if 0 <= t < VOCAB} | set(output):
                value = out[r, t]
                out[r, t] = value / penalty if value > 0 else value * penalty
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            presence = torch.tensor(params.presence_penalty, dtype=torch.float32)
            frequency = torch.tensor(params.frequency_penalty, dtype=torch.float32)
            for t, count in Counter(output).items():
                out[r, t] += -(presence + frequency * torch.tensor(float(count)))
    return out.clamp(max=torch.finfo(torch.float32).max)


def change(row: SamplingInfo, how: str, tokens: list[int]) -> SamplingInfo:
    """``row`` after one step of ``how``: the request's lists change in place, or are new."""
    row.guessed_ids = []
    if how == "append":
        row.output_ids.extend(tokens)
    elif how == "cut":
        del row.output_ids[len(tokens) :]
    elif how == "new output":
        return SamplingInfo(row.params, row.prompt_ids, tokens)
    elif how == "new prompt":
        return SamplingInfo(row.params, tokens, row.output_ids)
    else:
        row.guessed_ids = tokens
    return row


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_state_kept_between_steps_gives_the_from_scratch_logits(data: st.DataObject) -> None:
    sampler = Sampler()
    requests = [
        SamplingInfo(data.draw(st.sampled_from(PARAMS)), data.draw(TOKENS), data.draw(TOKENS))
        for _ in range(data.draw(st.integers(1, 4)))
    ]
    for step in range(data.draw(st.integers(1, 8))):
        requests = [
            change(row, data.draw(st.sampled_from(CHANGES)), data.draw(TOKENS)) for row in requests
        ]
        rows = list(requests)
        if data.draw(st.booleans()):  # a verified row: its guess rows share its lists
            base = requests[0]
            rows.append(SamplingInfo(base.params, base.prompt_ids, base.output_ids))
            rows[-1].guessed_ids = data.draw(TOKENS)
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step))
        expected = from_scratch(logits, rows)
        assert torch.equal(sampler._apply_penalties_and_bans(logits, rows), expected)
        assert torch.equal(Sampler()._apply_penalties_and_bans(logits, rows), expected)


PENALISED = SamplingParams(
    temperature=0, repetition_penalty=1.2, presence_penalty=0.1, frequency_penalty=0.1
)


@pytest.mark.parametrize("context", [1_000, 50_000])
def test_a_step_reads_only_the_tokens_its_rows_gained(context: int) -> None:
    vocab, rng, sampler = 32_000, random.Random(0), Sampler()
    rows = [
        SamplingInfo(PENALISED, [rng.randrange(vocab) for _ in range(context)], [])
        for _ in range(4)
    ]
    rows.append(SamplingInfo(SamplingParams(temperature=0), list(range(context)), []))
    logits = torch.randn(len(rows), vocab)
    states = sampler._penalty_states
    sampler.sample(logits, rows)
    assert states.tokens_read == 4 * context  # the first step reads each penalised prompt
    for _ in range(5):
        for row in rows:
            row.output_ids.extend([rng.randrange(vocab), rng.randrange(vocab)])
        guess_rows = [  # a verified row's guesses are read apart, never stored
            SamplingInfo(PENALISED, rows[0].prompt_ids, rows[0].output_ids, guessed_ids=[1, 2])
        ]
        before = states.tokens_read
        sampler.sample(torch.randn(len(rows) + 1, vocab), rows + guess_rows)
        assert states.tokens_read - before == 4 * 2
    del rows[0].output_ids[-3:]  # an output cut shorter is read again whole
    before = states.tokens_read
    sampler.sample(logits, rows)
    assert states.tokens_read - before == context + len(rows[0].output_ids)


def test_the_state_of_a_row_no_longer_sampled_goes() -> None:
    states = PenaltyStates(capacity=3, idle_calls=2)
    rows = [([i], [i, i]) for i in range(5)]
    states.rows(rows[:2])
    states.rows(rows[2:3])
    assert len(states) == 3
    states.rows(rows[2:3])  # rows 0 and 1 unused for two calls
    assert len(states) == 1
    states.rows(rows)  # five rows: the least recently used past the capacity go
    assert len(states) == 3
    before = states.tokens_read
    states.rows(rows[2:])
    assert states.tokens_read == before  # the three kept states read nothing new


def test_an_output_cut_or_rewritten_and_a_prompt_grown_are_read_again_whole() -> None:
    states = PenaltyStates()
    prompt, output = [1, 2], [3, 4, 5]
    states.rows([(prompt, output)])
    output[-1:] = [6, 7]  # the last token read rewritten, the list longer than read
    (state,) = states.rows([(prompt, output)])
    assert state.output_tokens.tolist() == [3, 4, 6, 7]
    assert state.output_counts.tolist() == [1, 1, 1, 1]
    del output[1:]
    (state,) = states.rows([(prompt, output)])
    assert (state.context.tolist(), state.output_tokens.tolist()) == ([1, 2, 3], [3])
    prompt.append(9)
    (state,) = states.rows([(prompt, output)])
    assert state.context.tolist() == [1, 2, 3, 9]


def test_a_verified_rows_guesses_count_as_its_output() -> None:
    """Penalties, bad words, min_new_tokens and the seeded step of a row with guesses are those
    of the row whose output holds the guesses."""
    params = SamplingParams(
        temperature=0.8,
        seed=7,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        min_new_tokens=6,
        stop_token_ids=[3],
        bad_words_token_ids=[[4, 5, 6]],
    )
    guessed = SamplingInfo(params, [7], [1, 4], guessed_ids=[5, 2, 4, 5])
    flat = SamplingInfo(params, [7], [1, 4, 5, 2, 4, 5])
    logits = torch.randn(1, 8).repeat(2, 1)
    processed = Sampler()._apply_penalties_and_bans(logits, [guessed, flat])
    assert torch.equal(processed[0], processed[1])
    assert processed[0, 6] == -torch.inf  # the guesses end the bad word's head
    assert processed[0, 3] > -torch.inf  # six tokens: min_new_tokens is met
    tokens, _ = Sampler().sample(logits, [guessed, flat])
    assert tokens[0] == tokens[1]
