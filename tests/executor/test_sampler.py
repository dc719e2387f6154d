"""Sampler: greedy, filters, penalties, seeded reproducibility, distributions, logprobs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.common.plan import SamplingInfo
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.penalties import (
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    bad_word_bans,
    ban_tokens,
    distinct_counts,
)
from asyncengine.executor.sampler import Sampler, greedy_tokens, seeded_uniform, splitmix64

# Search strategies that must all give the same tokens: the default, full sorts only, and a
# ratio so coarse that most top-p rows need the later passes.
SEARCHES = [(1e-4, 1e-9), (), (0.5, 0.01)]


def info(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> SamplingInfo:
    return SamplingInfo(params=params, prompt_ids=prompt or [], output_ids=output or [])


def reference_allowed(logits: np.ndarray, params: SamplingParams, slack: float = 1e-5) -> set[int]:
    """Tokens the filters may keep, computed independently in float64 from the definitions,
    with a little slack toward keeping more (float32 vs float64 at a boundary)."""
    vocab_size = logits.shape[0]
    finite = np.isfinite(logits)
    scaled = np.where(finite, logits / params.temperature, -np.inf)
    probs = np.exp(scaled - scaled.max())
    keep = finite.copy()
    if 0 < params.top_k < vocab_size:
        kth = np.sort(logits)[::-1][params.top_k - 1]
        keep &= logits >= kth
    if params.top_p < 1.0:
        kept_probs = np.where(keep, probs, 0.0)
        order = np.argsort(-logits, kind="stable")
        cumulative_before = np.cumsum(kept_probs[order]) - kept_probs[order]
        inside = cumulative_before < min(1.0, params.top_p + slack) * kept_probs.sum()
        last_value = logits[order][inside][-1]
        keep &= logits >= last_value
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * (1 - slack) * probs.max()
    return set(np.flatnonzero(keep).tolist())


# ---------------------------------------------------------------- greedy and the fast path


def test_greedy_equals_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    sampler = Sampler()
    tokens, logprobs = sampler.sample(logits, [info(SamplingParams(temperature=0.0))] * 16)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 16


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(10, 500)
    rows = [
        info(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=5, seed=i))
        for i in range(10)
    ]
    tokens, _ = Sampler().sample(logits, rows)
    assert tokens[::2] == logits[::2].argmax(dim=-1).tolist()


def test_sampler_does_not_modify_logits_and_accepts_bfloat16() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 300)
    before = logits.clone()
    params = SamplingParams(
        temperature=0.7, top_p=0.9, repetition_penalty=1.3, presence_penalty=1.0
    )
    Sampler(eos_token_ids=[3]).sample(logits, [info(params, [1, 2], [3, 4])] * 4)
    assert torch.equal(logits, before)
    tokens, _ = Sampler().sample(
        logits.to(torch.bfloat16), [info(SamplingParams(temperature=0))] * 4
    )
    assert tokens == logits.to(torch.bfloat16).float().argmax(dim=-1).tolist()


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(3, 10), [info(SamplingParams())] * 2)


def test_tiny_temperature_picks_the_best_and_single_token_vocabulary_works() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]] * 50)
    tokens, _ = Sampler(seed=0).sample(logits, [info(SamplingParams(temperature=1e-4))] * 50)
    assert set(tokens) == {1}
    tokens, _ = Sampler(seed=0).sample(torch.zeros(3, 1), [info(SamplingParams(top_p=0.5))] * 3)
    assert tokens == [0, 0, 0]


@pytest.mark.parametrize(
    "params",
    [
        # found by scripts/fuzz_api.py: each failed its forward (index out of bounds, a 500)
        SamplingParams(temperature=1e-320, top_p=0.9),
        SamplingParams(temperature=1e-300, min_p=0.5),
        SamplingParams(repetition_penalty=1e-300, top_k=5),
        SamplingParams(repetition_penalty=1e-300, top_p=0.5),
    ],
)
def test_extreme_temperatures_and_penalties_give_the_best_token(params: SamplingParams) -> None:
    logits = torch.full((2, 200), -5.0)
    logits[:, 37] = 4.0  # the best token, in the prompt so the penalty divides it past float32
    logits[:, 150] = 3.0
    tokens, _ = Sampler(seed=0).sample(logits, [info(params, prompt=[37])] * 2)
    assert tokens == [37, 37]
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy


# ---------------------------------------------------------------- filters: only allowed tokens


# Small rows take whole-row paths; rows of several 32-logit blocks exercise the candidates.
logit_rows = st.one_of(st.integers(1, 8), st.integers(64, 400)).flatmap(
    lambda size: st.one_of(
        # Coarse values: many ties, which the thresholds must keep consistently.
        st.lists(st.integers(-4, 4).map(float), min_size=size, max_size=size),
        st.lists(
            st.floats(-12, 12, allow_nan=False).map(lambda v: round(v, 2)),
            min_size=size,
            max_size=size,
        ),
    )
)
filter_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.25, 0.7, 1.0, 1.8]),
    top_k=st.one_of(st.just(-1), st.integers(1, 320)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(logit_rows, filter_params), min_size=1, max_size=4), data=st.data())
def test_filters_only_emit_allowed_tokens(
    rows: list[tuple[list[float], SamplingParams]], data: st.DataObject
) -> None:
    vocab_size = max(len(values) for values, _ in rows)
    batch: list[SamplingInfo] = []
    batch_logits: list[list[float]] = []
    allowed: list[set[int]] = []
    for values, params in rows:
        padded = values + [-math.inf] * (vocab_size - len(values))  # -inf: never allowed
        reference = reference_allowed(np.array(padded), params)
        for copy in range(12):  # the same row under many seeds and steps
            seed = None if copy % 4 == 0 else data.draw(st.integers(0, 2**40))
            row_params = SamplingParams(
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                min_p=params.min_p,
                seed=seed,
            )
            batch.append(info(row_params, output=[0] * copy))
            batch_logits.append(padded)
            allowed.append(reference)
    logits = torch.tensor(batch_logits, dtype=torch.float32)
    results = [
        Sampler(top_p_candidate_ratios=search, seed=1).sample(logits, batch)[0]
        for search in SEARCHES
    ]
    for tokens in results:
        for token, ok in zip(tokens, allowed, strict=True):
            assert token in ok
    seeded = [i for i, row in enumerate(batch) if row.params.seed is not None]
    for tokens in results[1:]:  # the search strategy never changes a seeded token
        assert [tokens[i] for i in seeded] == [results[0][i] for i in seeded]


def test_search_strategy_never_changes_a_token() -> None:
    generator = torch.Generator().manual_seed(12)
    vocab_size = 3000
    logits = torch.randn(40, vocab_size, generator=generator) * 2.5
    logits[::5] = logits[::5].round()  # coarse rows: ties everywhere, at every threshold
    configs = [
        dict(temperature=2.0, top_p=0.95),  # flat: the nucleus outgrows the first candidates
        dict(temperature=0.5, top_p=0.9),
        dict(temperature=1.0, top_p=0.6, min_p=0.01),
        dict(temperature=1.0, top_k=100, top_p=0.8),
        dict(temperature=0.8, top_k=7),
        dict(temperature=1.2, min_p=0.02),
        dict(temperature=1.5, top_k=200),  # more than the 94 blocks of 32: whole rows
        dict(temperature=1.0, top_p=0.999),
    ]
    rows = [
        info(SamplingParams(seed=i if i % 3 else None, **configs[i % len(configs)]))
        for i in range(40)
    ]
    results = [
        Sampler(top_p_candidate_ratios=search, seed=5).sample(logits, rows)[0]
        for search in SEARCHES
    ]
    assert results[1] == results[0] and results[2] == results[0]
    for token, row, values in zip(results[0], rows, logits.double().numpy(), strict=True):
        assert token in reference_allowed(values, row.params)


def test_top_k_and_top_p_keep_exactly_the_expected_sets() -> None:
    # probs (T=1) of logits log([0.4, 0.3, 0.2, 0.1]) : top-p 0.6 keeps {0, 1}; 0.71 keeps {0,1,2}
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]])).expand(1500, -1).contiguous()
    sampler = Sampler(seed=3)
    cases = [
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(top_p=0.6), {1, 3}),
        (SamplingParams(top_p=0.71), {1, 3, 2}),
        (SamplingParams(top_k=3, top_p=0.7), {1, 3}),  # renormalised over the top-3 mass 0.9
        (SamplingParams(min_p=0.6), {1, 3}),
        (SamplingParams(top_k=1), {1}),
    ]
    for params, expected in cases:
        tokens, _ = sampler.sample(logits, [info(params)] * 1500)
        assert set(tokens) == expected, params


def test_ties_at_a_threshold_are_all_kept() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]]).expand(1000, -1).contiguous()
    tokens, _ = Sampler(seed=4).sample(logits, [info(SamplingParams(top_k=2))] * 1000)
    assert set(tokens) == {1, 2, 3, 4}


# ---------------------------------------------------------------- distributions


def chi_square(tokens: list[int], expected_probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=expected_probs.shape[0]).astype(np.float64)
    expected = expected_probs * len(tokens)
    nonzero = expected > 0
    assert counts[~nonzero].sum() == 0, "a token with zero probability came out"
    return float((((counts - expected) ** 2)[nonzero] / expected[nonzero]).sum())


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_shapes_the_distribution(temperature: float) -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    expected = torch.softmax(logits / temperature, dim=0).double().numpy()
    rows = 20000
    tokens, _ = Sampler(seed=5).sample(
        logits.expand(rows, -1).contiguous(), [info(SamplingParams(temperature=temperature))] * rows
    )
    assert chi_square(tokens, expected) < 25.0  # 3 degrees of freedom: p < 1e-4
    # and the two temperatures are told apart: the top token's share moves a lot
    share = tokens.count(3) / rows
    assert (share > 0.8) if temperature == 0.5 else (share < 0.5)


def test_seeded_rows_follow_the_distribution_over_seeds_and_steps() -> None:
    logits = torch.tensor([0.5, 2.0, 1.0, -1.0, 1.5])
    expected = torch.softmax(logits, dim=0).double().numpy()
    rows = [info(SamplingParams(seed=s // 4), output=[7] * (s % 4)) for s in range(20000)]
    tokens, _ = Sampler().sample(logits.expand(len(rows), -1).contiguous(), rows)
    assert chi_square(tokens, expected) < 30.0  # 4 degrees of freedom: p < 1e-5


def test_whole_row_draw_across_blocks_and_filtered_draw_match_the_distribution() -> None:
    vocab_size = 2100  # the whole-row draw works in blocks of 1024
    hot = [0, 1023, 1024, 2047, 2099]
    logits = torch.full((vocab_size,), -7.0)
    logits[hot] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0])
    probs = torch.softmax(logits.double(), dim=0).numpy()
    grouped = np.append(probs[hot], 1.0 - probs[hot].sum())  # the cold tokens as one bucket
    rows = 5000
    batch = logits.expand(rows, -1).contiguous()
    tokens, _ = Sampler(seed=6).sample(batch, [info(SamplingParams())] * rows)
    bucket = [hot.index(t) if t in hot else len(hot) for t in tokens]
    assert chi_square(bucket, grouped) < 30.0

    # the hot tokens hold 0.96 of the mass, the first four 0.91: top-p 0.95 keeps all five
    params = SamplingParams(top_p=0.95)
    assert reference_allowed(logits.double().numpy(), params, slack=0.0) == set(hot)
    tokens, _ = Sampler(seed=7).sample(batch, [info(params)] * rows)
    assert set(tokens) <= set(hot)
    hot_probs = probs[hot] / probs[hot].sum()
    assert chi_square([hot.index(t) for t in tokens], hot_probs) < 25.0


# ---------------------------------------------------------------- seeded reproducibility


def seeded_rows(vocab_size: int) -> tuple[torch.Tensor, list[SamplingInfo]]:
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(12, vocab_size, generator=generator) * 3
    params = [
        SamplingParams(seed=11),
        SamplingParams(temperature=0.7, seed=12),
        SamplingParams(temperature=0.8, top_p=0.9, seed=13),
        SamplingParams(temperature=1.0, top_k=50, seed=14),
        SamplingParams(temperature=0.6, top_k=40, top_p=0.95, min_p=0.02, seed=15),
        SamplingParams(temperature=1.2, min_p=0.05, seed=16),
        SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.4, seed=17),
        SamplingParams(temperature=1.5, top_p=0.5, frequency_penalty=0.5, seed=-(2**63)),
        SamplingParams(temperature=0.0, seed=19),
        SamplingParams(temperature=2.0, top_p=0.999, seed=2**64 + 5),
        SamplingParams(temperature=0.3, top_k=vocab_size, seed=21),
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.8, seed=22),
    ]
    rows = [
        info(p, prompt=[1, 2, 3, 4], output=list(range(5, 5 + i))) for i, p in enumerate(params)
    ]
    return logits, rows


@pytest.mark.parametrize("vocab_size", [2000, 49152])
def test_seeded_tokens_do_not_depend_on_the_batch(vocab_size: int) -> None:
    logits, rows = seeded_rows(vocab_size)
    expected, _ = Sampler(seed=1).sample(logits, rows)

    alone = [Sampler(seed=2).sample(logits[i : i + 1], [rows[i]])[0][0] for i in range(len(rows))]
    assert alone == expected

    # shuffled, interleaved with unseeded rows, in a batch of 64
    rng = random.Random(9)
    extra_logits = torch.randn(52, vocab_size) * 2
    extra_rows = [
        info(SamplingParams(temperature=rng.choice([0.5, 1.0]), top_p=0.9)) for _ in range(52)
    ]
    order = list(range(64))
    rng.shuffle(order)
    all_logits = torch.cat([logits, extra_logits])
    all_rows = rows + extra_rows
    mixed, _ = Sampler(seed=3).sample(all_logits[order], [all_rows[i] for i in order])
    assert [mixed[order.index(i)] for i in range(len(rows))] == expected

    # another step (one more generated token) gives other draws
    later = [info(r.params, r.prompt_ids, r.output_ids + [0]) for r in rows]
    later_tokens, _ = Sampler(seed=1).sample(logits, later)
    assert later_tokens != expected


def test_unseeded_rows_follow_the_sampler_generator() -> None:
    logits = torch.randn(64, 500)
    rows = [info(SamplingParams())] * 64
    assert Sampler(seed=4).sample(logits, rows)[0] == Sampler(seed=4).sample(logits, rows)[0]
    assert Sampler(seed=4).sample(logits, rows)[0] != Sampler(seed=5).sample(logits, rows)[0]


def test_splitmix64_matches_a_python_reference() -> None:
    mask = (1 << 64) - 1

    def reference(value: int) -> int:
        z = (value + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    def to_signed(value: int) -> int:
        return value - (1 << 64) if value >= 1 << 63 else value

    rng = random.Random(10)
    inputs = [0, 1, -1, 2**63 - 1, -(2**63)] + [rng.getrandbits(64) for _ in range(200)]
    signed = [to_signed(v & mask) for v in inputs]
    got = splitmix64(torch.tensor(signed, dtype=torch.int64)).tolist()
    assert got == [to_signed(reference(v & mask)) for v in inputs]

    uniforms = seeded_uniform(torch.tensor(signed), torch.zeros(len(signed), dtype=torch.int64))
    assert bool(((uniforms >= 0) & (uniforms < 1)).all())
    assert len(set(uniforms.tolist())) > 190


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_once() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]])
    context = distinct_counts([0, 1, 1, 1, 9, -1])[0]  # 9 and -1: outside the vocab
    apply_repetition_penalty(logits, [0], [context], [2.0])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]]


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = torch.zeros(2, 5)
    apply_presence_frequency_penalties(logits, [1], [distinct_counts([2, 2, 3])], [0.5], [0.25])
    assert logits[0].tolist() == [0.0] * 5
    assert logits[1].tolist() == [0.0, 0.0, -1.0, -0.75, 0.0]


def test_ban_tokens_sets_minus_infinity() -> None:
    logits = torch.zeros(2, 4)
    ban_tokens(logits, [1], [[0, 3]])
    assert logits.tolist() == [[0.0] * 4, [-math.inf, 0.0, 0.0, -math.inf]]


def test_penalties_reach_the_sampler_over_the_right_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, -1.0]])
    greedy = Sampler()
    # frequency counts generated tokens only: token 0 in the prompt is not penalised
    params = SamplingParams(temperature=0, frequency_penalty=0.1)
    assert greedy.sample(logits, [info(params, prompt=[0, 0, 0], output=[1])])[0] == [0]
    assert greedy.sample(logits, [info(params, output=[0, 0])])[0] == [1]
    # presence: once is enough, counts do not matter
    params = SamplingParams(temperature=0, presence_penalty=0.3)
    assert greedy.sample(logits, [info(params, output=[0, 1, 1, 1])])[0] == [2]
    # repetition covers the prompt too; a negative logit gets more negative
    params = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert greedy.sample(logits, [info(params, prompt=[0], output=[1])])[0] == [2]


def test_min_new_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # eos = 1 is the favourite, then 2
    sampler = Sampler(eos_token_ids=[1])
    params = SamplingParams(temperature=0, min_new_tokens=2)
    assert sampler.sample(logits, [info(params, output=[3])])[0] == [2]
    assert sampler.sample(logits, [info(params, output=[3, 3])])[0] == [1]
    ignoring = SamplingParams(temperature=0, min_new_tokens=2, ignore_eos=True)
    assert sampler.sample(logits, [info(ignoring)])[0] == [1]
    stopping = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[2])
    assert sampler.sample(logits, [info(stopping)])[0] == [3]
    # sampled rows never emit a banned token either
    sampled = SamplingParams(temperature=5.0, min_new_tokens=1)
    tokens, _ = Sampler(eos_token_ids=[1], seed=0).sample(
        logits.expand(2000, -1), [info(sampled)] * 2000
    )
    assert 1 not in tokens and set(tokens) == {0, 2, 3}


def test_allowed_token_ids_and_bad_words_limit_the_next_token() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])
    sampler = Sampler(eos_token_ids=[])
    only = SamplingParams(temperature=0, allowed_token_ids=[0, 3])
    assert sampler.sample(logits, [info(only)])[0] == [3]
    sampled = SamplingParams(temperature=5.0, allowed_token_ids=[0, 4])
    tokens, _ = Sampler(eos_token_ids=[], seed=0).sample(
        logits.expand(500, -1), [info(sampled)] * 500
    )
    assert set(tokens) == {0, 4}
    # a two-token bad word bans its last token only after its first
    bad = SamplingParams(temperature=0, bad_words_token_ids=[[2, 1], [3]])
    assert sampler.sample(logits, [info(bad, output=[4])])[0] == [1]
    assert sampler.sample(logits, [info(bad, output=[2])])[0] == [2]
    # bans that leave no allowed token: allowed_token_ids win
    emptied = SamplingParams(temperature=0, allowed_token_ids=[3], bad_words_token_ids=[[3]])
    assert sampler.sample(logits, [info(emptied)])[0] == [3]


@settings(max_examples=200, deadline=None)
@given(
    output=st.lists(st.integers(0, 3), max_size=8),
    words=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6),
)
def test_bad_word_bans_are_the_last_tokens_of_the_words_the_output_ends_before(
    output: list[int], words: list[list[int]]
) -> None:
    expected = [
        w[-1]
        for w in words
        if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1 :] == w[:-1]
    ]
    assert bad_word_bans(output, words) == expected


def test_bad_words_are_bounded_in_tokens() -> None:
    SamplingParams(bad_words_token_ids=[[1] * 1024, [2] * 1024])
    with pytest.raises(ValueError, match="bad_words_token_ids=.*: at most 2048 tokens in all"):
        SamplingParams(bad_words_token_ids=[[1] * 1024, [2] * 1025])


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_and_top_n_is_sorted() -> None:
    torch.manual_seed(11)
    logits = torch.randn(5, 300) * 2
    rows = [
        info(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)),
        info(SamplingParams(temperature=0.8, top_k=20, logprobs=True, top_logprobs=3, seed=1)),
        info(SamplingParams(temperature=0.0)),
        info(
            SamplingParams(temperature=1.0, logprobs=True, seed=2, repetition_penalty=2.0), [5, 6]
        ),
        info(SamplingParams(temperature=0.5, top_logprobs=20, seed=3)),
    ]
    tokens, logprobs = Sampler().sample(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs[2] is None
    for row, n in [(0, 5), (1, 3), (3, 0), (4, 20)]:
        entry = logprobs[row]
        assert entry is not None
        assert entry.token_logprob == pytest.approx(reference[row, tokens[row]].item(), abs=1e-5)
        assert len(entry.top) == n
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        best = torch.topk(reference[row], n)
        assert [token for token, _ in entry.top] == best.indices.tolist()
        assert values == pytest.approx(best.values.tolist(), abs=1e-5)


def test_greedy_tokens_are_torch_argmax() -> None:
    """numpy's argmax for greedy rows: torch's first index on ties and first NaN, for rows of
    the vocabulary's width and odd ones, -inf rows, +inf, NaN in the SIMD part and the tail,
    strided rows."""
    torch.manual_seed(0)
    for vocab in (1, 7, 50, 49152):
        logits = torch.randn(5, vocab) * 6
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    wide = torch.randn(6, 300)
    wide[0, 100] = wide[0, 230] = 50.0
    wide[1, :] = float("-inf")
    wide[2, 77] = float("inf")
    wide[3, 120] = float("nan")
    wide[3, 200] = 1e9
    wide[4, 288] = float("nan")
    wide[5, 41] = wide[5, 45] = float("nan")
    rows = wide[:, 40:290]
    got = greedy_tokens(rows)
    assert got.dtype == torch.int64 and torch.equal(got, rows.argmax(dim=-1))
    assert got.tolist() == [60, 0, 37, 80, 248, 1]


@settings(max_examples=300, deadline=None)
@given(
    temperature=st.sampled_from([0.0, 0.7]),
    repetition=st.sampled_from([1.0, 1.3]),
    presence=st.sampled_from([0.0, 0.5]),
    frequency=st.sampled_from([0.0, -0.4]),
    bias=st.sampled_from([{}, {5: 2.0}]),
    logprobs=st.booleans(),
    top_logprobs=st.sampled_from([0, 2]),
    min_new=st.sampled_from([0, 3]),
    stops=st.sampled_from([[], [7]]),
    ignore_eos=st.booleans(),
    generated=st.integers(0, 5),
    masked=st.booleans(),
    eos=st.sampled_from([(), (2,)]),
    allowed=st.sampled_from([None, [5, 9]]),
    bad_words=st.sampled_from([[], [[12]], [[11, 14]]]),
)
def test_the_plain_greedy_shortcut_takes_exactly_the_rows_nothing_touches(
    temperature: float,
    repetition: float,
    presence: float,
    frequency: float,
    bias: dict[int, float],
    logprobs: bool,
    top_logprobs: int,
    min_new: int,
    stops: list[int],
    ignore_eos: bool,
    generated: int,
    masked: bool,
    eos: tuple[int, ...],
    allowed: list[int] | None,
    bad_words: list[list[int]],
) -> None:
    """A lone greedy row skips the general path only where that path would neither change its
    logits (penalties, bias, bans, grammar) nor report logprobs: then its token is the same. A
    row with bad words takes the general path even in a step none of them bans a token (that path
    finds its bans once a step)."""
    params = SamplingParams(
        temperature=temperature, repetition_penalty=repetition, presence_penalty=presence,
        frequency_penalty=frequency, logit_bias=bias, logprobs=logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs, min_new_tokens=min_new, max_new_tokens=8,
        stop_token_ids=stops, ignore_eos=ignore_eos, allowed_token_ids=allowed,
        bad_words_token_ids=bad_words,
    )  # fmt: skip
    mask = torch.full((2,), -1, dtype=torch.int32) if masked else None
    info = SamplingInfo(params, [3, 4], list(range(10, 10 + generated)), mask)
    sampler = Sampler(eos_token_ids=eos, seed=0)
    logits = torch.randn(1, 64)
    untouched = sampler._apply_penalties_and_bans(logits, [info]) is logits
    no_logprobs = sampler._logprobs(logits, [info], logits.argmax(-1)) == [None]
    expected = params.greedy and untouched and no_logprobs and not bad_words
    assert sampler._plain_greedy(info) == expected
    if sampler._plain_greedy(info):
        assert sampler.sample(logits, [info]) == ([int(logits.argmax())], [None])
