"""Output-length predictors: plug-in loading, each built-in, the policies that use them (sjf,
ltr) and the Kendall tau a run reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncengine import AsyncEngine
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies.base import PolicyContext
from asyncengine.policies.length_history import HistoryPredictor
from asyncengine.policies.length_predictor import (
    SCORED_PAIRS,
    LengthPredictions,
    LengthPredictor,
    MaxTokensPredictor,
    kendall_tau,
)
from asyncengine.policies.length_ranker import RankerPredictor
from asyncengine.policies.length_registry import build_length_predictor
from asyncengine.policies.registry import make_policy
from asyncengine.sim.simulator import simulate
from asyncengine.workloads import Arrivals, make_workload


def request(rid: str, prompt: list[int], tenant: str | None = None, max_new: int = 256) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new, tenant=tenant), 0.0)


class ByRid(LengthPredictor):
    """Predicts the number after the dash of the request id (test plug-in)."""

    name = "by-rid"

    def __init__(self, **options: Any) -> None:
        self.scale = float(options.pop("scale", 1.0))
        super().__init__(**options)

    def predict(self, req: Request) -> float:
        return self.scale * float(req.rid.split("-")[1])


def test_predictors_load_by_name_module_path_and_file(tmp_path: Path) -> None:
    assert isinstance(build_length_predictor("history"), HistoryPredictor)
    assert isinstance(build_length_predictor("Max_Tokens"), MaxTokensPredictor)
    loaded = build_length_predictor("tests.policies.test_length_predictors:ByRid", {"scale": 2})
    assert isinstance(loaded, ByRid) and loaded.predict(request("r-7", [1])) == 14.0
    plugin = tmp_path / "my_predictor.py"
    plugin.write_text(
        "from asyncengine.policies.length_predictor import LengthPredictor\n"
        "class Fixed(LengthPredictor):\n"
        "    name = 'fixed'\n"
        "    def predict(self, req):\n"
        "        return 42.0\n"
    )
    assert build_length_predictor(f"{plugin}:Fixed").predict(request("a", [1])) == 42.0


@pytest.mark.parametrize(
    ("spec", "options", "key"),
    [
        ("nope", None, "'length_predictor'"),
        (
            "tests.policies.test_length_predictors:request",
            None,
            "'length_predictor'",
        ),  # not a class
        ("no.such.module:Thing", None, "'length_predictor'"),
        ("history", {"quantile": 2.0}, "'length_predictor_options'"),
        ("history", {"max_keys": 2}, "'length_predictor_options'"),
        ("ranker", {"unknown": 1}, "'length_predictor_options'"),
    ],
)
def test_a_bad_predictor_or_option_names_its_config_key(
    spec: str, options: dict[str, Any] | None, key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        build_length_predictor(spec, options)


class NeedsAPath(LengthPredictor):
    """A plug-in whose constructor fails with no options (test plug-in)."""

    name = "needs-a-path"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        raise ValueError("no model file")

    def predict(self, req: Request) -> float:
        return 0.0


def test_a_predictor_that_fails_with_no_options_is_blamed_not_the_options() -> None:
    spec = "tests.policies.test_length_predictors:NeedsAPath"
    for options in (None, {}):
        with pytest.raises(ConfigError) as raised:
            build_length_predictor(spec, options)
        assert str(raised.value).startswith(f"config key 'length_predictor' = {spec!r}: ")
        assert "no model file" in str(raised.value) and "_options" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"^config key 'length_predictor_options' = \{'a': 1\}"):
        build_length_predictor(spec, {"a": 1})


def test_the_engine_refuses_the_oracle_outside_the_simulator() -> None:
    with pytest.raises(ConfigError, match="oracle"):
        AsyncEngine(EngineConfig(length_predictor="oracle"))


def test_kendall_tau() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one discordant pair of six: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # a constant prediction ranks nothing
    assert kendall_tau([5, 5, 5], [1, 2, 3]) != kendall_tau([5, 5, 5], [1, 2, 3])  # nan


def tau_b_by_its_definition(x: list[int], y: list[int]) -> float:
    """Every ordered pair compared: (concordant - discordant) over the untied pairs' root."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    sa, sb = np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :])
    norm = float(np.sqrt(np.abs(sa).sum() * np.abs(sb).sum()))
    return float((sa * sb).sum()) / norm if norm else float("nan")


@given(
    st.integers(2, 40).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 5), min_size=n, max_size=n),
            st.lists(st.integers(0, 5), min_size=n, max_size=n),
        )
    )
)
def test_kendall_tau_agrees_with_its_definition_with_ties(
    pair: tuple[list[int], list[int]],
) -> None:
    x, y = pair
    expected = tau_b_by_its_definition(x, y)
    got = kendall_tau(x, y)
    assert (np.isnan(expected) and np.isnan(got)) or got == pytest.approx(expected, abs=1e-12)


def test_history_predicts_each_tenant_and_bucket_quantile_with_fallbacks() -> None:
    history = HistoryPredictor(min_samples=2, default=99.0)
    short, long_prompt = [1] * 10, [1] * 1000
    assert history.predict(request("a", short, "chat")) == 99.0  # nothing seen
    for n in (10, 20, 30):
        history.observe(request("x", short, "chat"), n)
    for n in (500, 700):
        history.observe(request("y", long_prompt, "chat"), n)
    history.observe(request("z", short, "code"), 800)
    assert history.predict(request("b", short, "chat")) == 20.0  # its bucket's median
    assert history.predict(request("c", long_prompt, "chat")) == 600.0
    # an unseen bucket: the tenant's median over both buckets
    assert history.predict(request("d", [1] * 100, "chat")) == 30.0
    # one sample of "code" is too few: all requests' median
    assert history.predict(request("e", short, "code")) == 265.0  # (30 + 500) / 2
    assert HistoryPredictor(quantile=0.9, min_samples=1).predict(request("f", short)) == 128.0


def test_the_ranker_learns_which_template_answers_long() -> None:
    ranker = RankerPredictor()
    short_t, long_t = [7] * 8, [9] * 8
    for i in range(200):  # one template answers in ~5 tokens, the other in ~500
        ranker.observe(request("s", short_t + [i] * (20 + i % 7)), 5 + i % 3)
        ranker.observe(request("l", long_t + [i] * (20 + i % 5)), 500 + i % 50)
    assert ranker.trained == 400
    short_guess = ranker.predict(request("q", short_t + [1] * 30))
    long_guess = ranker.predict(request("q", long_t + [1] * 30))
    assert short_guess < 20 and long_guess > 200


def test_predictions_are_asked_again_once_the_predictor_learned_and_scored_at_the_end() -> None:
    history = HistoryPredictor(min_samples=1, default=50.0)
    book = LengthPredictions(history)
    waiting = request("w", [1, 2, 3], "t")
    assert book.predicted_len(waiting) == 50.0
    done = request("d", [1, 2, 3], "t")
    done.output_ids = [1] * 8
    done.finish_reason = "stop"
    book.finished(done)  # history learns 8 for tenant t
    assert book.predicted_len(waiting) == 8.0
    waiting.output_ids = [1] * 9
    waiting.finish_reason = "length"
    book.finished(waiting)
    aborted = request("a", [1], "t")
    book.predicted_len(aborted)
    aborted.finish_reason = "abort"
    book.finished(aborted)  # no actual length: neither learned nor scored
    assert list(book.pairs) == [(8.0, 9)] and book.observed == 2
    assert book.stats()["name"] == "history" and book.stats()["scored"] == 1


def test_history_forgets_the_least_recent_tenants_past_max_keys() -> None:
    # a server whose clients send a new ``user`` each must not keep every one of them
    history = HistoryPredictor(min_samples=1, default=99.0, max_keys=64)
    prompt = [1, 2, 3]
    for i in range(1000):
        history.observe(request(f"r{i}", prompt, f"user-{i}"), 10)
    history.observe(request("old", prompt, "user-0"), 500)  # forgotten, then seen again
    assert len(history.seen) <= 64
    assert history.predict(request("a", prompt, "user-0")) == 500.0  # its own again
    assert history.predict(request("b", prompt, "user-999")) == 10.0  # recent: still known
    assert history.predict(request("c", prompt, "user-1")) == 10.0  # forgotten: all requests'


def test_scored_pairs_stay_bounded_and_score_the_latest_endings() -> None:
    # every ending of a long-running server is scored; the pairs kept must not grow with them
    book = LengthPredictions(MaxTokensPredictor())
    extra = 200
    for i in range(SCORED_PAIRS + extra):
        # the first ``extra`` end in the reverse order of their prediction, the rest in order
        req = request(f"r{i}", [1], max_new=1000 + i)
        book.predicted_len(req)
        req.output_ids = [1] * (extra - i if i < extra else i)
        req.finish_reason = "length"
        book.finished(req)
    assert len(book.pairs) == SCORED_PAIRS
    stats = book.stats()
    assert stats["scored"] == SCORED_PAIRS + extra
    assert stats["kendall_tau"] == pytest.approx(1.0)  # the latest endings only


def context(predict: Any) -> PolicyContext:
    return PolicyContext(
        config=EngineConfig(),
        now=0.0,
        num_running=0,
        num_decodes=0,
        prefix_len=lambda ids: 0,
        chunked=None,
        predicted_len=predict,
    )


def test_sjf_and_ltr_rank_by_the_predicted_output() -> None:
    big_prompt_short_answer = request("a-5", [1] * 400)
    small_prompt_long_answer = request("b-300", [1] * 10)
    medium = request("c-100", [1] * 150)
    waiting = [small_prompt_long_answer, medium, big_prompt_short_answer]
    ctx = context(ByRid().predict)
    # sjf: prompt + predicted output (405, 310, 250); ltr: predicted output alone
    assert [r.rid for r in make_policy("sjf").order(waiting, ctx)] == ["c-100", "b-300", "a-5"]
    assert [r.rid for r in make_policy("ltr").order(waiting, ctx)] == ["a-5", "c-100", "b-300"]
    # with the default predictor (max_new_tokens, 256 each) sjf goes by prompt size
    default = context(lambda r: float(r.params.max_new_tokens))
    assert [r.rid for r in make_policy("sjf").order(waiting, default)][0] == "b-300"


def test_a_simulated_run_scores_each_predictor_against_the_trace() -> None:
    work = make_workload("task_mix", num_requests=200, seed=1, arrivals=Arrivals.parse("poisson:4"))
    taus = {}
    for name in ("oracle", "history", "ranker"):
        config = EngineConfig(policy="ltr", length_predictor=name, log_interval=0)
        scored = simulate(config, work).core_stats["length_predictor"]
        assert scored["name"] == name and scored["scored"] > 100
        taus[name] = scored["kendall_tau"]
    assert taus["oracle"] == pytest.approx(1.0)
    assert 0.2 < taus["history"] < 1.0 and 0.2 < taus["ranker"] < 1.0


def test_the_replica_simulator_reveals_the_trace_to_the_oracle() -> None:
    from asyncengine.routing import make_router
    from asyncengine.sim.multi_replica import MultiReplicaSimulator

    work = make_workload("task_mix", num_requests=60, seed=2, arrivals=Arrivals.parse("poisson:2"))
    config = EngineConfig(policy="ltr", length_predictor="oracle", log_interval=0)
    simulator = MultiReplicaSimulator(config, 2, make_router("round-robin"))
    assert simulator.run(work).summary.num_completed == 60
    for replica in simulator.replicas:
        scored = replica.core.stats()["length_predictor"]
        assert scored["scored"] == 0 or scored["kendall_tau"] > 0.99
