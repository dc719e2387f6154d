"""Speculative decoding through the real runner: a tiny random llama on the CPU verifies guesses
in one forward over the paged KV. Greedy outputs equal decoding without speculation token for
token (float32, and deterministic mode), whatever the guesses; the sampled distribution of a
verified row is the model's (a chi-square test on the runner's verification); a seeded request
samples the same tokens with or without guesses; grammars reject guesses they refuse."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from asyncengine.executor.model_executor import ModelExecutor
from asyncengine.executor.runner import ModelRunner
from asyncengine.executor.sampler import Sampler
from tests.server_support import engine_config, tiny_model_dir
from tests.speculative.test_speculative import OracleProposer

PROMPTS = [
    [101, 102, 103, 104, 105, 106] * 4,
    list(range(300, 337)),
    [7, 8, 9] * 9 + [500, 501],
]
OUTPUT = 24


def make_core(
    model_dir: str, speculative: dict[str, object] | None, **overrides: object
) -> EngineCore:
    config = engine_config(model_dir, speculative=speculative, **overrides)
    core = build_core(config, ModelExecutor(config))
    core.step_hooks.append(lambda plan: core.check_invariant())
    return core


def run(core: EngineCore, reqs: list[Request]) -> None:
    for req in reqs:
        core.add(req)
    while core.has_work():
        core.step()


def greedy(rid: str, prompt: list[int], n: int = OUTPUT, **params: object) -> Request:
    return Request(
        rid, prompt, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **params), 0.0
    )  # type: ignore[arg-type]


# they favour what the output repeats, so that they change the tiny random model's tokens
PENALTIES = {"repetition_penalty": 0.7, "presence_penalty": -1.5, "frequency_penalty": 0.6}


@pytest.mark.parametrize(
    ("deterministic", "penalties"),
    [(False, {}), (True, {}), (False, PENALTIES)],
    ids=["float32", "deterministic", "penalties"],
)
def test_greedy_with_guesses_equals_greedy_without(
    tmp_path_factory: pytest.TempPathFactory, deterministic: bool, penalties: dict[str, float]
) -> None:
    """Penalties included: a verified row's guesses count as its output, on top of the penalty
    state the sampler keeps for the request."""
    model = str(tiny_model_dir(tmp_path_factory))
    plain = make_core(model, None, deterministic=deterministic)
    reference = [greedy(f"p{i}", p, **penalties) for i, p in enumerate(PROMPTS)]
    run(plain, reference)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "rule": "fixed"}
    core = make_core(model, spec, deterministic=deterministic)
    reqs = []
    for i, (prompt, ref) in enumerate(zip(PROMPTS, reference, strict=True)):
        req = greedy(f"s{i}", prompt, **penalties)
        # right guesses, wrong ones at every position, and none
        req.proposer = OracleProposer(prompt + ref.output_ids, [[0], [1, 3, 0, 5, 2], [4, 2]][i])
        reqs.append(req)
    reqs.append(greedy("ngram", PROMPTS[0], **penalties))  # the real proposer
    run(core, reqs)
    assert [r.output_ids for r in reqs[:3]] == [r.output_ids for r in reference]
    assert reqs[3].output_ids == reference[0].output_ids
    assert reqs[0].accepted_guesses > 0 and reqs[1].accepted_guesses < reqs[1].proposed_guesses
    assert core.stats()["pages_used"] == 0


def verify(
    logits: torch.Tensor,
    guesses: list[int],
    params: SamplingParams,
    sampler: Sampler,
    output_ids: list[int] | None = None,
) -> list[int]:
    """The tokens the runner's verification emits for one row with ``guesses`` and per-position
    ``logits`` [len(guesses) + 1, V]."""
    seg = Segment("r", 0, [1, *guesses], 10, True, guesses=len(guesses))
    plan = BatchPlan(step=1, decodes=[seg], sampling=[SamplingInfo(params, [1], output_ids or [])])
    out = ModelRunner._verify(SimpleNamespace(sampler=sampler), plan, logits)  # type: ignore[arg-type]
    return [*guesses[: out.accepted[0]], out.token_ids[0]]


def test_verified_rows_sample_the_model_distribution() -> None:
    rng = np.random.default_rng(3)
    vocab = 6
    logits = torch.tensor(rng.normal(0, 1.2, (3, vocab)), dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1).numpy()
    guesses = [int(probs[0].argmax()), 2]
    sampler = Sampler(seed=11)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    trials = 6000
    first = np.zeros(vocab)
    second = np.zeros(vocab)  # after the first guess was accepted
    for _ in range(trials):
        tokens = verify(logits, guesses, params, sampler)
        first[tokens[0]] += 1
        if tokens[0] == guesses[0]:
            second[tokens[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        expected = counts.sum() * p
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (counts, expected)  # p < 0.001 for 5 degrees of freedom
    # and the wrong distribution is told apart: the first token is not p[1]'s
    wrong = first.sum() * probs[1]
    assert float(((first - wrong) ** 2 / wrong).sum()) > 50


def test_a_seeded_row_samples_the_same_tokens_with_or_without_guesses() -> None:
    rng = np.random.default_rng(5)
    logits = torch.tensor(rng.normal(0, 1.0, (4, 50)), dtype=torch.float32)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=1234)
    sampler = Sampler(seed=0)
    # one token per step, the way a non-speculative decode draws them
    one_by_one: list[int] = []
    for j in range(4):
        info = SamplingInfo(params, [1], list(one_by_one))
        one_by_one.append(sampler.sample(logits[j : j + 1], [info])[0][0])
    # guesses that are the same tokens: all accepted, the bonus token is the 4th draw
    assert verify(logits, one_by_one[:3], params, sampler) == one_by_one
    # a wrong second guess: the first is kept, then the draw the plain step would have made
    wrong = [one_by_one[0], (one_by_one[1] + 1) % 50, one_by_one[2]]
    assert verify(logits, wrong, params, sampler) == one_by_one[:2]
