"""No run beats the offline hit bound: the simulator under every built-in policy, on random
small workloads (shared prefixes shorter and longer than a page, chats that send an answer
back), never caches more prompt tokens than ``optimal_hit`` over the prompts and answers; and
``compare_policies`` reports that bound beside each run."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.common.config import EngineConfig
from asyncengine.policies.registry import BUILTIN
from asyncengine.sim.simulated_executor import SAMPLED_TOKEN_ID
from asyncengine.sim.simulator import simulate
from asyncengine.workloads.trace import WorkloadRequest, save_trace
from tests.scripts.test_compare_policies import load_script

TOKENS = st.integers(2, 6)  # few distinct tokens: prompts share prefixes by chance too


@st.composite
def workloads(draw: st.DrawFn) -> list[WorkloadRequest]:
    """Requests behind a few shared heads; some are a chat's next turn: an earlier request's
    prompt, its answer as the simulator samples it, then a new message."""
    heads = draw(st.lists(st.lists(TOKENS, max_size=12), min_size=1, max_size=3))
    requests: list[WorkloadRequest] = []
    for k in range(draw(st.integers(1, 8))):
        message = draw(st.lists(TOKENS, min_size=1, max_size=6))
        if requests and draw(st.booleans()):
            before = requests[draw(st.integers(0, len(requests) - 1))]
            prompt = [*before.prompt_ids, *[SAMPLED_TOKEN_ID] * before.output_len, *message]
        else:
            prompt = [*draw(st.sampled_from(heads)), *message]
        arrival = draw(st.sampled_from([0.0, 0.001, 0.05, 1.0])) * k
        requests.append(WorkloadRequest(f"r{k}", arrival, prompt, draw(st.integers(1, 6))))
    return requests


def answers(workload: list[WorkloadRequest]) -> list[list[int]]:
    return [[SAMPLED_TOKEN_ID] * w.output_len for w in workload]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([1, 4, 16]), st.booleans())
def test_no_policy_caches_more_than_the_infinite_bound(
    workload: list[WorkloadRequest], page_size: int, small_pool: bool
) -> None:
    prompts = [w.prompt_ids for w in workload]
    bound = optimal_hit(prompts, 1, answers(workload))
    longest = max(len(w.prompt_ids) + w.output_len for w in workload)
    pool = 2 * longest + 2 * page_size if small_pool else 4096  # small: evictions, retractions
    for policy in sorted(BUILTIN):
        config = EngineConfig(
            policy=policy,
            page_size=page_size,
            kv_cache_tokens=pool,
            max_model_len=longest + page_size,
            chunked_prefill_size=0,
        )
        result = simulate(config, workload)
        cached = sum(r.cached_tokens for r in result.records)
        assert cached <= bound.hit_tokens, (policy, cached, bound)
        assert result.summary.cache_hit_rate <= bound.rate


def test_the_bound_counts_answers_a_later_prompt_sends_back() -> None:
    first, answer = [5, 6, 7], [8, 9]
    later = [*first, *answer, 4]
    # over prompts alone the answer is never cached: 3 of the later prompt's 6 tokens
    assert optimal_hit([first, later]).hit_tokens == 3
    assert optimal_hit([first, later], 1, [answer, [1]]).hit_tokens == 5
    # whole pages of 2: [5 6] [7 8] [9 4]; the page holding 7 and the answer's 8 is decoded
    assert optimal_hit([first, later], 2).hit_tokens == 2
    assert optimal_hit([first, later], 2, [answer, [1]]).hit_tokens == 4
    # an answer no prompt sends back changes nothing; a prompt still computes its last token
    assert optimal_hit([first, first], 1, [answer, answer]) == optimal_hit([first, first])
    assert optimal_hit([[*first, 8]], 1, [[1]]).hit_tokens == 0


def compare(tmp_path: Path, workload: list[WorkloadRequest], page_size: int) -> list[object]:
    save_trace(tmp_path / "w.jsonl", workload)
    return load_script("compare_policies").main(  # type: ignore[no-any-return]
        [
            "--workload", str(tmp_path / "w.jsonl"), "--policies", "fcfs", "lpm",
            "--set", f"page_size={page_size}", "kv_cache_tokens=4096", "max_model_len=256",
            "--out", str(tmp_path / "out"), "--no-figures",
        ]
    )  # fmt: skip


def test_compare_policies_bound_counts_partial_pages(tmp_path: Path) -> None:
    # every prompt shares 10 tokens, less than a page of 16: no whole page is ever shared,
    # but kept tail pages and copies within a step share them
    head = list(range(100, 110))
    workload = [
        WorkloadRequest(f"r{k}", 0.5 * k * (k % 2), [*head, 200 + k, 300 + k], 1) for k in range(12)
    ]
    assert optimal_hit([w.prompt_ids for w in workload], 16).hit_tokens == 0
    runs = compare(tmp_path, workload, 16)
    for run in runs:
        assert run.summary.cache_hit_rate > 0  # type: ignore[attr-defined]
        assert run.summary.cache_hit_rate <= run.optimal_hit_rate  # type: ignore[attr-defined]
        assert run.summary.cache_hit_rate <= run.pool_hit_rate  # type: ignore[attr-defined]


def test_compare_policies_bound_counts_the_answers_sent_back(tmp_path: Path) -> None:
    # each chat's second turn sends back the first turn's answer (the simulator's tokens)
    workload = []
    for chat in range(4):
        first = [50 + chat] * 4 + list(range(10, 18))
        workload.append(WorkloadRequest(f"c{chat}-0", chat * 0.1, first, 12))
        later = [*first, *[SAMPLED_TOKEN_ID] * 12, 60 + chat, 61]
        workload.append(WorkloadRequest(f"c{chat}-1", 5.0 + chat * 0.1, later, 4))
    prompts = [w.prompt_ids for w in workload]
    runs = compare(tmp_path, workload, 4)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for run in runs:
        hit = run.summary.cache_hit_rate  # type: ignore[attr-defined]
        assert optimal_hit(prompts).rate < hit <= run.optimal_hit_rate  # type: ignore[attr-defined]
        assert summary[run.label]["optimal_hit_rate"] == run.optimal_hit_rate  # type: ignore[attr-defined]
