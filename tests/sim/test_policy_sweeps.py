"""compare_policies' grids (--sweep), simulated replicas (--replicas, --router) and Ray
fan-out (--ray): the same table and figures as a local run."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.policies.eviction_registry import build_eviction_rule
from asyncengine.sim.sweep import SimJob, expand, parse_sweep
from tests.scripts.test_compare_policies import load_script

WORKLOAD_ARGS = [
    "--workload", "shared_prefix",
    "--workload-arg", "num_groups=6", "questions_per_group=4", "prefix_len=64",
    "vocab_size=300", "output_len=6",
    "--arrivals", "poisson:40",
    "--set", "page_size=4", "kv_cache_tokens=512", "max_model_len=512", "chunked_prefill_size=64",
]  # fmt: skip


def test_parse_and_expand_a_grid() -> None:
    sweep = parse_sweep(["chunked_prefill_size=64,128", "router=cache-aware,round-robin"])
    assert sweep == [
        ("chunked_prefill_size", [64, 128]),
        ("router", ["cache-aware", "round-robin"]),
    ]
    jobs = expand([SimJob("lpm", EngineConfig(policy="lpm"), replicas=2)], sweep)
    assert [j.label for j in jobs] == [
        "lpm chunked_prefill_size=64 router=cache-aware",
        "lpm chunked_prefill_size=64 router=round-robin",
        "lpm chunked_prefill_size=128 router=cache-aware",
        "lpm chunked_prefill_size=128 router=round-robin",
    ]
    assert [j.config.chunked_prefill_size for j in jobs] == [64, 64, 128, 128]
    assert {j.replicas for j in jobs} == {2} and jobs[1].router == "round-robin"
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        parse_sweep(["replicas"])


def test_a_json_object_with_commas_is_one_sweep_value() -> None:
    sweep = parse_sweep(
        ['policy_options={"aging":0.5,"max_wait_tokens":100},{"aging":1.0}', "x=1,a,,[1,2],b"]
    )
    assert sweep == [
        ("policy_options", [{"aging": 0.5, "max_wait_tokens": 100}, {"aging": 1.0}]),
        ("x", [1, "a", "", [1, 2], "b"]),
    ]
    jobs = expand([SimJob("sjf", EngineConfig(policy="sjf"))], sweep[:1])
    assert [j.config.policy_options for j in jobs] == [
        {"aging": 0.5, "max_wait_tokens": 100},
        {"aging": 1.0},
    ]
    with pytest.raises(ValueError, match="not a JSON object or list"):
        parse_sweep(['policy_options={"aging":0.5,},{}'])


def test_a_swept_rule_leaves_the_config_rules_options_behind(tmp_path: Path) -> None:
    rule = tmp_path / "rule.py"
    rule.write_text(
        "from asyncengine.cache.eviction_rule import EvictionRule\n\n\n"
        "class Mine(EvictionRule):\n"
        "    def __init__(self, weight: float = 1.0) -> None:\n"
        "        self.weight = weight\n"
    )
    config = EngineConfig(eviction_policy=f"{rule}:Mine", eviction_policy_options={"weight": 2.0})
    same_file = f"{tmp_path}/../{tmp_path.name}/rule.py:Mine"
    sweep = parse_sweep([f"eviction_policy=lru,lfu,{same_file}"])
    jobs = expand([SimJob("fcfs", config)], sweep)
    assert [j.config.eviction_policy_options for j in jobs] == [{}, {}, {"weight": 2.0}]
    for job in jobs:  # each run builds: lru is not handed the file rule's weight
        build_eviction_rule(job.config.eviction_policy, job.config.eviction_policy_options)
    own = expand([SimJob("fcfs", config)], parse_sweep(["eviction_policy_options={}"]))
    assert own[0].config.eviction_policy_options == {}


def test_a_sweep_of_settings_and_replicas_is_one_command(tmp_path: Path) -> None:
    compare = load_script("compare_policies")
    runs = compare.main(
        ["--policies", "fcfs", *WORKLOAD_ARGS, "--sweep", "replicas=1,2",
         "router=cache-aware,round-robin", "--no-figures", "--out", str(tmp_path)]
    )  # fmt: skip
    labels = [r.label for r in runs]
    assert labels == [
        "fcfs replicas=1 router=cache-aware",
        "fcfs replicas=1 router=round-robin",
        "fcfs replicas=2 router=cache-aware",
        "fcfs replicas=2 router=round-robin",
    ]
    by_label = {r.label: r for r in runs}
    one = [by_label[f"fcfs replicas=1 router={r}"] for r in ("cache-aware", "round-robin")]
    assert one[0].records == one[1].records  # one replica: the router has no choice
    for run in runs:
        assert run.summary.num_completed == 24
    table = (tmp_path / "results.md").read_text()
    assert all(label in table for label in labels)


def test_real_runs_refuse_replicas(tmp_path: Path) -> None:
    compare = load_script("compare_policies")
    with pytest.raises(SystemExit, match="apply to simulated runs"):
        compare.main(["--policies", "fcfs", *WORKLOAD_ARGS, "--real", "--replicas", "2",
                      "--out", str(tmp_path)])  # fmt: skip


@pytest.mark.slow
def test_ray_tasks_give_the_local_table_and_figures(tmp_path: Path) -> None:
    compare = load_script("compare_policies")
    args = ["--policies", "fcfs", "lpm", *WORKLOAD_ARGS,
            "--sweep", "chunked_prefill_size=32,64", "--replicas", "2"]  # fmt: skip
    local = compare.main([*args, "--out", str(tmp_path / "local")])
    fanned = compare.main([*args, "--ray", "--out", str(tmp_path / "ray")])
    assert [r.label for r in fanned] == [r.label for r in local]
    assert [r.records for r in fanned] == [r.records for r in local]
    for name in ("results.md", "ttft_cdf.png", "itl_p99.png", "hit_rate.png"):
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
