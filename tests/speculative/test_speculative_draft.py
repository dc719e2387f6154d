"""Speculative decoding by a draft model: tiny random llamas with the default tokenizer as target
and draft, on the CPU. Greedy outputs equal decoding without speculation token for token
(float32 and deterministic mode) with the target as its own draft (nearly every guess accepted)
and with another checkpoint (fewer); the draft's KV pages go when a request finishes, is
aborted or retracted (its rows are always those of running requests); n > 1 choices draft on
their own; seeded sampled requests draw the same tokens with or without a draft; a bad draft is
a config error naming ``speculative.model``."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import SupportsIndex, overload

import pytest

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from asyncengine.executor.model_executor import ModelExecutor
from asyncengine.speculative.draft.draft_proposer import DraftProposer
from tests.server_support import engine_config, tiny_model_dir

PROMPTS = [
    [101, 102, 103, 104, 105, 106] * 4,
    list(range(300, 337)),
    [7, 8, 9] * 9 + [500, 501],
]
OUTPUT = 24


def draft_spec(model: Path | str, k: int = 4, **extra: object) -> dict[str, object]:
    return {"method": "draft", "model": str(model), "num_speculative_tokens": k, **extra}


def make_core(
    model_dir: Path, speculative: dict[str, object] | None, **overrides: object
) -> EngineCore:
    config = engine_config(model_dir, speculative=speculative, **overrides)
    core = build_core(config, ModelExecutor(config))
    core.step_hooks.append(lambda plan: core.check_invariant())
    return core


def drafter_of(core: EngineCore) -> DraftProposer:
    drafter = core.executor.drafter  # type: ignore[attr-defined]
    assert isinstance(drafter, DraftProposer)
    return drafter


def watch_draft_rows(core: EngineCore) -> list[int]:
    """Check, at every drafting step once released rows are dropped, that the draft holds KV
    only for rows of running requests (each its own) and that its page accounting holds.
    Returns a list that counts the checks."""
    drafter = drafter_of(core)
    checks: list[int] = []
    propose = drafter.propose

    def checked(plan: BatchPlan) -> object:
        running = {req.kv.row: req.rid for req in core.scheduler.running}
        for row, rid in drafter.held_rows().items():
            assert running.get(row) == rid, (row, rid, running)
        drafter.kv.check_invariant()
        checks.append(len(drafter.held_rows()))
        return propose(plan)

    drafter.propose = checked  # type: ignore[method-assign]
    return checks


def run(core: EngineCore, reqs: list[Request]) -> None:
    for req in reqs:
        core.add(req)
    while core.has_work():
        core.step()


def greedy(rid: str, prompt: list[int], n: int = OUTPUT) -> Request:
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return Request(rid, prompt, params, 0.0)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another checkpoint of the same tokenizer: one layer, other random weights."""
    return tiny_model_dir(tmp_path_factory, num_hidden_layers=1)


@pytest.fixture(scope="module")
def references(target: Path) -> dict[bool, list[list[int]]]:
    """Greedy outputs without speculation, by deterministic mode."""
    out = {}
    for deterministic in (False, True):
        core = make_core(target, None, deterministic=deterministic)
        reqs = [greedy(f"p{i}", p) for i, p in enumerate(PROMPTS)]
        run(core, reqs)
        out[deterministic] = [r.output_ids for r in reqs]
    return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["float32", "deterministic"])
def test_greedy_with_a_draft_model_equals_greedy_without(
    target: Path,
    other_draft: Path,
    references: dict[bool, list[list[int]]],
    deterministic: bool,
) -> None:
    rates = {}
    for name, draft in (("self", target), ("other", other_draft)):
        core = make_core(target, draft_spec(draft, rule="fixed"), deterministic=deterministic)
        checks = watch_draft_rows(core)
        reqs = [greedy(f"s{i}", p) for i, p in enumerate(PROMPTS)]
        run(core, reqs)
        assert [r.output_ids for r in reqs] == references[deterministic], name
        proposed = sum(r.proposed_guesses for r in reqs)
        accepted = sum(r.accepted_guesses for r in reqs)
        assert proposed > 0 and checks
        rates[name] = accepted / proposed
        stats = core.stats()
        assert stats["spec_verified_tokens"] == proposed
        assert stats["spec_accepted_tokens"] == accepted
        # fewer steps than tokens: guesses were kept
        assert stats["steps"] < len(PROMPTS) * OUTPUT
    assert rates["self"] > 0.9, rates  # the target guessing for itself
    assert rates["other"] < rates["self"], rates


def test_draft_pages_go_when_requests_finish_or_are_aborted(target: Path) -> None:
    core = make_core(target, draft_spec(target, rule="fixed"))
    drafter = drafter_of(core)
    watch_draft_rows(core)
    short, long, aborted = (
        greedy("short", PROMPTS[0], 6),
        greedy("long", PROMPTS[1], 40),
        greedy("aborted", PROMPTS[2], 40),
    )
    for req in (short, long, aborted):
        core.add(req)
    while not short.finished:
        core.step()
    assert len(drafter.held_rows()) == 3  # released rows go at the next step
    core.step()
    assert sorted(drafter.held_rows().values()) == ["aborted", "long"]
    core.step()
    assert core.abort("aborted")
    core.step()
    assert list(drafter.held_rows().values()) == ["long"]
    used = drafter.kv.stats()["pages_used"]
    assert used == len(drafter.kv.open_seqs()[0].pages) > 0
    while core.has_work():
        core.step()
    assert long.output_ids == greedy_reference(target, PROMPTS[1], 40)
    # the next plan (any request's) drops the finished request's draft KV
    run(core, [greedy("next", PROMPTS[0], 2)])
    core.step()  # nothing to run: no plan, nothing dropped
    run(core, [greedy("last", PROMPTS[0], 1)])
    assert drafter.kv.stats()["pages_used"] == 0 and not drafter.held_rows()
    assert core.stats()["pages_used"] == 0


def greedy_reference(target: Path, prompt: list[int], n: int) -> list[int]:
    core = make_core(target, None)
    req = greedy("ref", prompt, n)
    run(core, [req])
    return req.output_ids


def test_retracted_requests_drop_their_draft_kv_and_still_match(target: Path) -> None:
    # few KV pages: guesses are dropped first, then requests are retracted and recomputed
    overrides = {
        "kv_cache_tokens": 16 * 14,
        "init_new_token_ratio": 0.1,
        "min_new_token_ratio": 0.1,
    }
    prompts = [[10 + i, 11, 12, 13, 14, 15, 16] * 3 for i in range(5)]
    plain = make_core(target, None, **overrides)
    expected = [greedy(f"p{i}", p, 30) for i, p in enumerate(prompts)]
    run(plain, expected)
    core = make_core(target, draft_spec(target, rule="fixed"), **overrides)
    checks = watch_draft_rows(core)
    reqs = [greedy(f"r{i}", p, 30) for i, p in enumerate(prompts)]
    run(core, reqs)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in expected]
    assert core.stats()["retractions"] >= 1 and checks
    assert sum(r.accepted_guesses for r in reqs) > 0


def test_n_choices_draft_on_their_own(target: Path, other_draft: Path) -> None:
    core = make_core(target, draft_spec(other_draft, k=3, rule="fixed"))
    watch_draft_rows(core)
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    leader = Request("c0", PROMPTS[2], params, 0.0)
    follower = Request("c1", PROMPTS[2], params, 0.0)
    core.add(leader, [follower])
    while core.has_work():
        core.step()
    expected = greedy_reference(target, PROMPTS[2], 20)
    assert leader.output_ids == follower.output_ids == expected
    assert leader.proposed_guesses > 0 and follower.proposed_guesses > 0


def test_seeded_sampling_draws_the_same_tokens_with_a_draft(
    target: Path, other_draft: Path
) -> None:
    """Guesses are the draft's argmax (a point mass), verified by drawing from the target at
    each position with the uniform a one-token step would use: a seeded request's tokens do not
    depend on the guesses, so the output distribution is the target's (test_speculative_model.py
    checks the verification's distribution with a chi-square test)."""

    def sampled(speculative: dict[str, object] | None) -> list[list[int]]:
        core = make_core(target, speculative)
        reqs = [
            Request(
                f"r{seed}",
                PROMPTS[seed % 3],
                SamplingParams(max_new_tokens=16, temperature=0.7, seed=seed, ignore_eos=True),
                0.0,
            )
            for seed in range(6)
        ]
        run(core, reqs)
        assert all(len(r.output_ids) == 16 for r in reqs)
        if speculative is not None:
            assert sum(r.proposed_guesses for r in reqs) > 0
        return [r.output_ids for r in reqs]

    assert sampled(draft_spec(other_draft, rule="fixed")) == sampled(None)


# -- config errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"method": "draft"}, "speculative.model"),
        ({"method": "draft", "model": " "}, "speculative.model"),
        (
            {"method": "draft", "model": "m", "prompt_lookup_min": 2},
            "speculative.prompt_lookup_min",
        ),
        ({"method": "ngram", "model": "m"}, "speculative.model"),
    ],
)
def test_a_bad_draft_setting_is_a_config_error_naming_the_key(
    values: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError, match="speculative") as info:
        EngineConfig(speculative=values)
    assert key in str(info.value)


def test_the_draft_method_in_toml(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('speculative = {method = "draft", model = "/models/small"}\n')
    settings = EngineConfig.from_toml(path).speculation
    assert settings is not None and settings.method == "draft"
    assert settings.model == "/models/small" and settings.num_speculative_tokens == 4


def test_a_draft_that_cannot_be_loaded_is_a_config_error(target: Path, tmp_path: Path) -> None:
    config = engine_config(target, speculative=draft_spec(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="speculative.model") as info:
        ModelExecutor(config)
    assert "cannot load" in str(info.value)


def test_a_draft_of_another_tokenizer_is_a_config_error(target: Path, tmp_path: Path) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.__getitem__)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = engine_config(target, speculative=draft_spec(draft))
    with pytest.raises(ConfigError, match="speculative.model") as info:
        ModelExecutor(config)
    assert "tokenizer is not the target model's" in str(info.value)


def test_the_simulator_refuses_a_draft_model() -> None:
    from asyncengine.sim.simulator import Simulator

    config = EngineConfig(speculative=draft_spec("/models/small"))
    with pytest.raises(ConfigError, match="speculative"):
        Simulator(config)


class CountedIds(list[int]):
    """Token ids that count the tokens read from them (one per index, a slice's length, all of
    both lists for a concatenation). A list: the plan's compiled classes take no other type."""

    read = 0

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> int | list[int]:
        got = super().__getitem__(index)
        self.read += len(got) if isinstance(got, list) else 1
        return got

    def __add__(self, other: list[int]) -> list[int]:  # type: ignore[override]
        self.read += len(self) + len(other)
        return [*self, *other]


@pytest.mark.parametrize("prompt_len", [20, 400])
def test_a_drafting_step_reads_the_new_tokens_not_the_whole_context(
    target: Path, prompt_len: int
) -> None:
    """After its first proposal (the whole prompt's catch-up) a row's draft reads a few tokens
    a step, however long its context."""
    k = 3
    core = make_core(target, draft_spec(target, k=k, rule="fixed"))
    drafter = drafter_of(core)
    propose = drafter.propose
    reads: list[int] = []

    def counted(plan: BatchPlan) -> object:
        ids = [(CountedIds(i.prompt_ids), CountedIds(i.output_ids)) for i in plan.sampling]
        sampling = [
            replace(info, prompt_ids=prompt, output_ids=output)
            for info, (prompt, output) in zip(plan.sampling, ids, strict=True)
        ]
        guessing = propose(replace(plan, sampling=sampling))
        reads.append(sum(prompt.read + output.read for prompt, output in ids))
        return guessing

    drafter.propose = counted  # type: ignore[method-assign]
    run(core, [greedy("long", [(7 * i) % 900 + 5 for i in range(prompt_len)], 12)])
    assert len(reads) >= 2
    assert reads[0] >= prompt_len  # the first proposal catches up on the whole prompt
    # then its last token and those accepted since its previous proposal (k + 1 at most)
    assert max(reads[1:]) <= 1 + k + 1
