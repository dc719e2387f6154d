"""The sampler's logit_bias and grammar bitmasks: masks act on their rows only, agree with
xgrammar's own kernel, leave seeded rows' tokens batch-independent, and win over bans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.common.plan import SamplingInfo
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.executor.penalties import allowed_tokens, apply_token_bitmasks
from asyncengine.executor.sampler import Sampler

VOCAB = 1000
WORDS = -(-VOCAB // 32)


def bitmask(allowed: list[int]) -> torch.Tensor:
    bits = np.zeros(WORDS * 32, dtype=np.uint8)
    bits[allowed] = 1
    return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


def info(params: SamplingParams, mask: torch.Tensor | None = None) -> SamplingInfo:
    return SamplingInfo(params, [], [], mask)


def test_bitmask_layout_matches_xgrammar() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    rng = np.random.default_rng(0)
    masks = torch.from_numpy(rng.integers(-(2**31), 2**31, (3, WORDS), dtype=np.int64)).to(
        torch.int32
    )
    logits = torch.randn(3, VOCAB)
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, masks, backend="torch_native")
    ours = logits.clone()
    assert apply_token_bitmasks(ours, [0, 1, 2], list(masks)) == []
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert allowed_tokens(masks, VOCAB).sum() == torch.isfinite(theirs).sum()


def test_masks_apply_to_their_rows_only() -> None:
    logits = torch.randn(3, VOCAB)
    allowed = [5, 17, 999]
    sampler = Sampler(seed=0)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1)
        for _ in range(20):
            tokens, _ = sampler.sample(
                logits, [info(params), info(params, bitmask(allowed)), info(params)]
            )
            assert tokens[1] in allowed
    # greedy on the unmasked rows is the plain argmax
    tokens, _ = sampler.sample(
        logits[:2],
        [info(SamplingParams(temperature=0)), info(SamplingParams(temperature=0), bitmask([3]))],
    )
    assert tokens == [int(logits[0].argmax()), 3]


def test_seeded_row_ignores_its_neighbours_masks() -> None:
    logits = torch.randn(2, VOCAB)
    params = SamplingParams(temperature=1.0, seed=42)
    sampler = Sampler(seed=0)
    alone, _ = sampler.sample(logits[:1], [info(params)])
    beside, _ = sampler.sample(logits, [info(params), info(params, bitmask([1, 2]))])
    assert alone[0] == beside[0]


def test_grammar_wins_over_min_tokens_bans() -> None:
    """Below min_new_tokens EOS is banned; a grammar that allows only EOS still gets it."""
    logits = torch.randn(1, VOCAB)
    sampler = Sampler(eos_token_ids=[2], seed=0)
    params = SamplingParams(temperature=0.0, min_new_tokens=3, max_new_tokens=5)
    tokens, _ = sampler.sample(logits, [info(params, bitmask([2]))])
    assert tokens == [2]
    tokens, _ = sampler.sample(logits, [info(params, bitmask([2, 7]))])
    assert tokens == [7]


def test_logit_bias_adds_to_its_tokens() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 5.0
    sampler = Sampler(seed=0)
    greedy = SamplingParams(temperature=0.0)
    tokens, logprobs = sampler.sample(
        logits,
        [
            info(SamplingParams(temperature=0.0, logit_bias={10: -100.0, 20: 3.0}, logprobs=True)),
            info(greedy),
        ],
    )
    assert tokens == [20, 10]
    # logprobs stay those of the raw logits
    raw = torch.log_softmax(logits[0], dim=-1)
    assert logprobs[0] is not None and logprobs[0].token_logprob == pytest.approx(raw[20].item())
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias={7: 100.0})
    assert all(sampler.sample(logits[:1], [info(sampled)])[0] == [7] for _ in range(5))


@pytest.mark.parametrize(
    ("bias", "says"),
    [({-1: 1.0}, "key -1"), ({3: 101.0}, "not in \\[-100, 100\\]"), ({"3": 1.0}, "key '3'")],
)
def test_bad_logit_bias_is_refused(bias: dict, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says):
        SamplingParams(logit_bias=bias)


def test_scattered_masks_at_a_real_vocabulary_refuse_exactly_their_tokens() -> None:
    """At Qwen2.5's 151,936 logits, 16 masks whose allowed tokens are scattered (as inside a
    JSON string): refused tokens are -inf, a NaN among them too, and the rest as they were
    (a NaN that is allowed stays one). The cost of such masks is measured by
    scripts/bench_structured.py, not here."""
    vocab, rows = 151_936, 16
    words = -(-vocab // 32)
    rng = np.random.default_rng(0)
    scattered = torch.from_numpy(
        rng.integers(-(2**31), 2**31, (rows, words), dtype=np.int64).astype(np.int32)
    )
    logits = torch.randn(rows, vocab)
    logits[:, ::97] = float("nan")
    work = logits.clone()
    apply_token_bitmasks(work, list(range(rows)), list(scattered))
    allowed = torch.from_numpy(allowed_tokens(scattered, vocab).copy())
    kept, given = work[allowed], logits[allowed]
    assert torch.equal(kept.isnan(), given.isnan())
    assert torch.equal(kept.nan_to_num(0.0), given.nan_to_num(0.0))
    assert bool((work[~allowed] == float("-inf")).all())
