"""Whatever the sampling parameters, a row with a grammar mask gets a token the mask allows:
random combinations of logit_bias, penalties, min_new_tokens bans, stop ids, temperature,
top-k, top-p, min-p and seeds, over random logits and random masks (at least one token
allowed), in batches that mix constrained and free rows."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.common.plan import SamplingInfo
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.penalties import allowed_tokens
from asyncengine.executor.sampler import Sampler

VOCAB = 2100  # past two draw blocks, with a partial tail block
WORDS = -(-VOCAB // 32)
EOS = 2


def _mask(allowed: list[int]) -> torch.Tensor:
    bits = np.zeros(WORDS * 32, dtype=np.uint8)
    bits[allowed] = 1
    return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


tokens = st.integers(0, VOCAB - 1)
params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(1e-5, 2.0), st.floats(2.0, 1e6)),
    top_k=st.one_of(st.just(-1), st.integers(1, VOCAB + 10)),
    top_p=st.one_of(st.just(1.0), st.floats(1e-9, 1.0, exclude_min=True)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(1e-300, 10.0, exclude_min=True)),
    logit_bias=st.dictionaries(tokens, st.floats(-100, 100), max_size=20),
    stop_token_ids=st.lists(tokens, max_size=4),
    min_new_tokens=st.integers(0, 8),
    max_new_tokens=st.just(8),
    ignore_eos=st.booleans(),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    logprobs=st.booleans(),
)


@st.composite
def rows(draw: st.DrawFn) -> tuple[SamplingParams, list[int] | None, list[int]]:
    params = draw(params_strategy)
    allowed = draw(st.one_of(st.none(), st.lists(tokens, min_size=1, max_size=30, unique=True)))
    output = draw(st.lists(tokens, max_size=6))
    return params, allowed, output


@settings(max_examples=300, deadline=None)
@given(
    batch=st.lists(rows(), min_size=1, max_size=4),
    scale=st.sampled_from([1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_sampled_token_is_allowed_by_its_mask(
    batch: list[tuple[SamplingParams, list[int] | None, list[int]]], scale: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(batch), VOCAB, generator=generator) * scale
    infos = [
        SamplingInfo(params, [1, 5, 9], output, None if allowed is None else _mask(allowed))
        for params, allowed, output in batch
    ]
    sampled, _ = Sampler(eos_token_ids=[EOS], seed=seed).sample(logits, infos)
    for token, info, (_, allowed, _) in zip(sampled, infos, batch, strict=True):
        assert 0 <= token < VOCAB
        if allowed is not None:
            assert info.token_bitmask is not None
            ok = allowed_tokens(torch.stack([info.token_bitmask]), VOCAB)[0]
            assert ok[token], (token, sorted(allowed), info.params)
