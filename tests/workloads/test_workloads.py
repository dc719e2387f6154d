from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncengine.workloads import (
    WORKLOADS,
    Arrivals,
    WorkloadRequest,
    load_trace,
    long_short,
    make_workload,
    multi_turn,
    pseudo_text,
    random_lengths,
    save_trace,
    shared_prefix,
    tree_of_thought,
)

SMALL: dict[str, dict[str, object]] = {
    "random": {"num_requests": 40},
    "shared_prefix": {"num_groups": 3, "questions_per_group": 5, "prefix_len": 64},
    "multi_turn": {"num_conversations": 4, "num_turns": 3, "output_len": 8},
    "tree_of_thought": {"num_trees": 2, "depth": 2, "branching": 2, "root_len": 32},
    "long_short": {"num_requests": 12, "short_len": 4},
    "multi_tenant": {"num_heavy": 20, "num_light": 4},
    "priority_mix": {"num_requests": 30},
    "slo_mix": {"num_requests": 30, "long_median": 600.0},
    "task_mix": {"num_requests": 30},
    "adapter_mix": {"num_requests": 30},
    "hot_adapter_flood": {"num_hot": 20, "per_cold": 2},
    "hot_scan": {"num_requests": 24, "system_len": 64, "scan_median": 64.0, "max_scan_len": 256},
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_are_deterministic_per_seed(name: str) -> None:
    first = make_workload(name, seed=3, **SMALL[name])
    again = make_workload(name, seed=3, **SMALL[name])
    other = make_workload(name, seed=4, **SMALL[name])
    assert first == again
    assert [r.prompt_ids for r in first] != [r.prompt_ids for r in other]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_respect_vocab_and_give_unique_ids(name: str) -> None:
    requests = make_workload(name, vocab_size=50, **SMALL[name])
    assert len({r.rid for r in requests}) == len(requests)
    assert all(0 <= t < 50 for r in requests for t in r.prompt_ids)
    assert all(r.prompt_ids and r.output_len >= 1 for r in requests)


def test_random_lengths_follow_the_bounds() -> None:
    requests = random_lengths(500, min_input_len=8, max_input_len=300, max_output_len=100)
    input_lens = [len(r.prompt_ids) for r in requests]
    output_lens = [r.output_len for r in requests]
    assert min(input_lens) >= 8 and max(input_lens) <= 300
    assert max(output_lens) <= 100
    assert len(set(input_lens)) > 50  # a spread, not one length


def test_shared_prefix_groups_share_their_prefix() -> None:
    requests = shared_prefix(num_groups=3, questions_per_group=4, prefix_len=20, seed=1)
    prefixes = {tuple(r.prompt_ids[:20]) for r in requests}
    assert len(prefixes) == 3
    assert len(requests) == 12
    assert all(len(r.prompt_ids) > 20 for r in requests)


def test_multi_turn_prompts_extend_the_previous_turn_and_answer() -> None:
    requests = multi_turn(num_conversations=2, num_turns=3, output_len=5, system_len=7)
    assert len(requests) == 6
    for turn in range(1, 3):
        for conversation in range(2):
            previous = requests[(turn - 1) * 2 + conversation].prompt_ids
            current = requests[turn * 2 + conversation].prompt_ids
            assert current[: len(previous)] == previous
            assert len(current) > len(previous) + 5  # answer (5 tokens) + user message
    assert requests[0].prompt_ids[:7] == requests[1].prompt_ids[:7]  # shared system prompt


def test_tree_of_thought_children_extend_their_parent() -> None:
    requests = tree_of_thought(num_trees=1, depth=2, branching=3, root_len=10, branch_len=4)
    assert len(requests) == 1 + 3 + 9
    root, level1, level2 = requests[0], requests[1:4], requests[4:]
    for i, child in enumerate(level1):
        assert child.prompt_ids[:10] == root.prompt_ids and len(child.prompt_ids) == 14
        for grandchild in level2[3 * i : 3 * i + 3]:
            assert grandchild.prompt_ids[:14] == child.prompt_ids
    assert len({tuple(r.prompt_ids) for r in level2}) == 9


def test_long_short_pattern_and_arrivals() -> None:
    requests = long_short(8, short_len=3, long_factor=64)
    assert [len(r.prompt_ids) for r in requests] == [3, 3, 3, 192] * 2
    assert [r.arrival_time for r in requests] == pytest.approx([0.02 * i for i in range(8)])


def test_arrival_processes() -> None:
    assert Arrivals("burst").times(3) == [0.0, 0.0, 0.0]
    assert Arrivals("interval", interval=0.5).times(3) == [0.0, 0.5, 1.0]
    times = Arrivals("poisson", rate=100.0).times(4000, seed=1)
    assert times == sorted(times) and times[0] == 0.0
    assert Arrivals("poisson", rate=100.0).times(10, seed=1) == times[:10]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert math.isclose(sum(gaps) / len(gaps), 0.01, rel_tol=0.1)
    assert Arrivals.parse("poisson:5") == Arrivals("poisson", rate=5.0)
    assert Arrivals.parse("interval:0.02") == Arrivals("interval", interval=0.02)
    with pytest.raises(ValueError):
        Arrivals.parse("poisson")
    with pytest.raises(ValueError):
        Arrivals("poisson", rate=0.0)


def test_arrivals_apply_to_generators() -> None:
    requests = random_lengths(20, arrivals=Arrivals("poisson", rate=10.0), seed=2)
    times = [r.arrival_time for r in requests]
    assert times == sorted(times) and times[-1] > 0


def test_trace_round_trip_is_exact(tmp_path: Path) -> None:
    requests = random_lengths(30, arrivals=Arrivals("poisson", rate=7.3), text=True, seed=5)
    requests.append(WorkloadRequest("odd", 1 / 3, [0, 1, 2], 1, prompt_text='quote " and \n'))
    path = tmp_path / "trace.jsonl"
    save_trace(path, requests)
    assert load_trace(path) == requests
    assert len(path.read_text().splitlines()) == len(requests)


def test_bad_trace_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"rid": "a", "arrival_time": 0, "prompt_ids": [1], "output_len": 2}\n{"rid": "b"}\n'
    )
    with pytest.raises(ValueError, match=":2:"):
        load_trace(path)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("arrival_time", "NaN", "finite"),  # never arrives: the simulator waited forever
        ("arrival_time", "Infinity", "finite"),
        ("arrival_time", "-100", ">= 0"),
        ("arrival_time", "true", "number"),
        ("output_len", "3.9", "whole number"),
        ("output_len", "-1", "whole number"),
        ("prompt_ids", "[1, -2]", "token ids"),
        ("prompt_ids", "[true]", "token ids"),
    ],
)
def test_a_trace_value_a_run_cannot_take_is_refused(
    tmp_path: Path, field: str, value: str, says: str
) -> None:
    fields = {"rid": '"a"', "arrival_time": "0", "prompt_ids": "[1]", "output_len": "2"}
    fields[field] = value
    path = tmp_path / "bad.jsonl"
    path.write_text("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}\n")
    with pytest.raises(ValueError, match=says):
        load_trace(path)


def test_pseudo_text_is_injective_per_token() -> None:
    words = pseudo_text(range(20000)).split(" ")
    assert len(set(words)) == 20000
    requests = shared_prefix(num_groups=1, questions_per_group=2, prefix_len=5, text=True)
    assert requests[0].prompt_text is not None
    assert requests[0].prompt_text.split(" ")[:5] == requests[1].prompt_text.split(" ")[:5]


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")


def test_multi_tenant_has_a_heavy_and_a_light_tenant() -> None:
    requests = make_workload("multi_tenant", num_heavy=60, num_light=6, seed=2)
    heavy = [r for r in requests if r.tenant == "heavy"]
    light = [r for r in requests if r.tenant == "light"]
    assert len(heavy) == 60 and len(light) == 6
    assert [r.arrival_time for r in requests] == sorted(r.arrival_time for r in requests)
    mean = lambda rs: sum(len(r.prompt_ids) for r in rs) / len(rs)  # noqa: E731
    assert mean(heavy) > 4 * mean(light)


def test_priority_mix_and_slo_mix_shares() -> None:
    mix = make_workload("priority_mix", num_requests=400, interactive_share=0.25, seed=1)
    interactive = [r for r in mix if r.priority == 0]
    assert 60 < len(interactive) < 140 and all(r.output_len == 16 for r in interactive)
    assert all(r.priority == 1 and r.output_len == 128 for r in mix if r not in interactive)
    slo = make_workload("slo_mix", num_requests=400, long_share=0.1, seed=1)
    docs = [r for r in slo if r.rid.startswith("doc")]
    assert 20 < len(docs) < 70 and min(len(r.prompt_ids) for r in docs) >= 512
    with pytest.raises(ValueError):
        make_workload("priority_mix", interactive_share=2.0)


def test_task_mix_lengths_follow_each_tasks_medians() -> None:
    import statistics

    from asyncengine.workloads.generators import TASKS, task_mix

    requests = task_mix(800, seed=2)
    for tenant, _, prompt_median, output_median in TASKS:
        mine = [r for r in requests if r.tenant == tenant]
        assert len(mine) > 100
        templates = {tuple(r.prompt_ids[:24]) for r in mine}
        assert len(templates) == 1  # one instruction per task
        outputs = statistics.median(r.output_len for r in mine)
        prompts = statistics.median(len(r.prompt_ids) - 24 for r in mine)
        assert 0.8 * output_median <= outputs <= 1.25 * output_median
        assert 0.8 * prompt_median <= prompts <= 1.25 * prompt_median


def test_copy_heavy_prompts_hold_code_or_prose_to_rewrite() -> None:
    from asyncengine.workloads.copy_heavy import copy_heavy_prompts, random_text_prompts

    prompts = copy_heavy_prompts(4, seed=3)
    assert prompts == copy_heavy_prompts(4, seed=3)
    assert "```python\ndef " in prompts[0][0]["content"]
    assert len(prompts[1][0]["content"].split()) > 40
    words = random_text_prompts(2, seed=3, words=50)[0][0]["content"].split()
    assert len(words) == 53  # "Continue this text:" and 50 words
