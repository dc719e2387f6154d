from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from asyncengine.workloads import load_trace, tree_of_thought

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write_config(path: Path, policy: str) -> Path:
    path.write_text(
        f'policy = "{policy}"\npage_size = 4\nkv_cache_tokens = 2048\nmax_model_len = 1024\n'
        "chunked_prefill_size = 64\n"
    )
    return path


def test_compare_policies_in_the_simulator_writes_table_and_figures(tmp_path: Path) -> None:
    compare = load_script("compare_policies")
    configs = [write_config(tmp_path / f"{p}.toml", p) for p in ("fcfs", "lpm", "dfs-weight")]
    out = tmp_path / "out"
    runs = compare.main(
        [
            "--configs",
            *map(str, configs),
            "--policies",
            "lpm+token-budget",
            "--set",
            "page_size=4",
            "kv_cache_tokens=2048",
            "max_model_len=1024",
            "--workload",
            "shared_prefix",
            "--workload-arg",
            "num_groups=3",
            "questions_per_group=6",
            "prefix_len=48",
            "vocab_size=300",
            "output_len=6",
            "--arrivals",
            "poisson:50",
            "--sim",
            "--out",
            str(out),
        ]
    )
    labels = ["fcfs", "lpm", "dfs-weight", "lpm+token-budget"]
    assert [run.label for run in runs] == labels
    table, *sections = (out / "results.md").read_text().split("\n## ")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "config" not in line]
    assert [row.split("|")[1].strip() for row in rows] == labels
    assert any(s.startswith("Why admission stopped") for s in sections)
    for name in ("ttft_cdf.png", "itl_p99.png", "hit_rate.png", "summary.json", "workload.jsonl"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"
    details = json.loads((out / "summary.json").read_text())
    assert set(details) == set(labels)
    assert all(d["summary"]["num_completed"] == 18 for d in details.values())
    assert all(0 < d["optimal_hit_rate"] < 1 for d in details.values())
    assert all(run.summary.cache_hit_rate <= run.optimal_hit_rate + 1e-12 for run in runs)
    assert len(load_trace(out / "workload.jsonl")) == 18


def test_compare_policies_replays_a_trace_file(tmp_path: Path) -> None:
    compare = load_script("compare_policies")
    gen = load_script("gen_workload")
    trace = tmp_path / "tot.jsonl"
    info = gen.main(
        [
            "tree_of_thought",
            "--out",
            str(trace),
            "--page-size",
            "4",
            "--arg",
            "num_trees=2",
            "--arg",
            "depth=2",
            "--arg",
            "root_len=40",
            "--arg",
            "vocab_size=200",
            "--arg",
            "output_len=4",
        ]
    )
    assert info["requests"] == 2 * (1 + 3 + 9)
    assert load_trace(trace) == tree_of_thought(
        num_trees=2, depth=2, root_len=40, vocab_size=200, output_len=4
    )
    out = tmp_path / "out"
    runs = compare.main(
        [
            "--policies",
            "fcfs",
            "--set",
            "page_size=4",
            "kv_cache_tokens=4096",
            "--workload",
            str(trace),
            "--out",
            str(out),
            "--no-figures",
        ]
    )
    assert len(runs) == 1 and runs[0].summary.num_completed == 26
    assert runs[0].optimal_hit_rate == pytest.approx(info["optimal_hit_rate"], abs=1e-4)
    assert not (out / "ttft_cdf.png").exists()


def test_compare_policies_compares_eviction_rules_one_of_them_from_a_file(
    tmp_path: Path,
) -> None:
    """A rule of one's own runs beside the built-ins; the table calls it by its name and puts
    each rule beside the lru run of the same policy."""
    (tmp_path / "deep.py").write_text(
        "from asyncengine.cache.eviction_rule import CachedNode, EvictionRule\n\n\n"
        "class Deepest(EvictionRule):\n"
        "    def key(self, node: CachedNode) -> float:\n"
        "        return float(node.prefix_len)\n"
    )
    compare = load_script("compare_policies")
    out = tmp_path / "out"
    runs = compare.main(
        [
            *("--policies", "fcfs", "lpm", "--workload", "hot_scan", "--workload-arg"),
            *("num_requests=40", "system_len=64", "scan_median=64.0", "max_scan_len=256"),
            *("output_len=4", "--arrivals", "poisson:4", "--set", "page_size=4"),
            *("kv_cache_tokens=512", "max_model_len=512", "--eviction"),
            f"lru,lfu,{tmp_path / 'deep.py'}:Deepest",
            *("--no-figures", "--out", str(out)),
        ]
    )
    assert len(runs) == 6
    # the file's rule goes by its name in the labels (tables, figures), not by its path
    assert [r.label for r in runs[:3]] == [
        "fcfs eviction_policy=lru",
        "fcfs eviction_policy=lfu",
        "fcfs eviction_policy=Deepest",
    ]
    table = (out / "results.md").read_text().split("## Eviction rules")[1].split("\n## ")[0]
    rows = [
        line.split("|")
        for line in table.splitlines()
        if line.startswith("| fcfs") or line.startswith("| lpm")
    ]
    assert [r[2].strip() for r in rows] == ["lru", "lfu", "Deepest"] * 2
    hits = [int(r[3]) for r in rows]
    assert hits[2] < hits[0]  # the file's rule is in charge: it keeps less than lru here
    for first in (0, 3):
        for k in range(3):
            gain = hits[first + k] / hits[first] - 1
            assert rows[first + k][6].strip() == f"{gain:+.1%}"


def test_compare_policies_calls_a_policy_of_ones_own_by_its_name(tmp_path: Path) -> None:
    """--policies path.py:Class labels the run with the class's ``name``, as the engine's stats
    do; the policy column keeps the spec that reproduces it. A class the file lacks fails
    before anything is written."""
    (tmp_path / "mine.py").write_text(
        "from asyncengine.policies.fcfs import FCFSPolicy\n\n\n"
        "class Newest(FCFSPolicy):\n"
        "    name = 'newest-first'\n\n"
        "    def order(self, waiting, ctx):\n"
        "        return waiting[::-1]\n"
    )
    compare = load_script("compare_policies")
    out, spec = tmp_path / "out", f"{tmp_path / 'mine.py'}:Newest"
    args = ["--workload", "random", "--workload-arg", "num_requests=3", "--no-figures"]
    runs = compare.main(["--policies", "fcfs", spec, *args, "--out", str(out)])
    assert [(run.label, run.policy) for run in runs] == [("fcfs", "fcfs"), ("newest-first", spec)]
    assert f"| newest-first | `{spec}` |" in (out / "results.md").read_text()
    assert set(json.loads((out / "summary.json").read_text())) == {"fcfs", "newest-first"}
    with pytest.raises(ValueError, match="defines no 'Oldest'"):
        compare.main(["--policies", f"{spec[:-6]}Oldest", *args, "--out", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()


def test_compare_policies_says_which_rows_a_failing_policy_did_not_measure(
    tmp_path: Path,
) -> None:
    """A hook that raises hands the run to FCFS: its row measures FCFS, and the report says so
    for that row alone."""
    (tmp_path / "broken.py").write_text(
        "from asyncengine.policies.base import Policy\n\n\n"
        "class Broken(Policy):\n"
        "    orders = True\n\n"
        "    def order(self, waiting, ctx):\n"
        "        raise RuntimeError('a bug of the policy')\n"
    )
    compare = load_script("compare_policies")
    out = tmp_path / "out"
    broken = f"{tmp_path / 'broken.py'}:Broken"
    args = ["--policies", "fcfs", broken, "--workload", "random", "--workload-arg"]
    runs = compare.main([*args, "num_requests=4", "--no-figures", "--out", str(out)])
    assert [run.engine_stats["policy_failures"] for run in runs] == [0, 1]
    notes = [p for p in (out / "results.md").read_text().split("\n\n") if "policy failed" in p]
    assert len(notes) == 1 and "`Broken` (1 failure)" in notes[0]
    assert "`fcfs`" not in notes[0]


def test_compare_policies_refuses_bad_arguments(tmp_path: Path) -> None:
    compare = load_script("compare_policies")
    with pytest.raises(SystemExit):
        compare.main(["--workload", "random", "--out", str(tmp_path)])  # no configs
    with pytest.raises(SystemExit):
        compare.main(
            [
                "--policies",
                "fcfs",
                "--workload",
                "random",
                "--workload-arg",
                "oops",
                "--out",
                str(tmp_path),
            ]
        )


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (["--real", "--cost-model", "model.json"], "--cost-model is the simulator's step cost"),
        (["--think-time", "2"], "add --closed-loop"),
    ],
)
def test_compare_policies_refuses_an_option_its_mode_would_ignore(
    given: list[str], says: str, tmp_path: Path
) -> None:
    compare = load_script("compare_policies")
    out = tmp_path / "out"
    args = ["--policies", "fcfs", "--workload", "random", "--out", str(out)]
    with pytest.raises(SystemExit, match=says):
        compare.main([*args, *given])
    assert not out.exists()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (written directly, no transformers import) with the embedded default
    model's tokenizer files, so the engine starts in about a second."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from asyncengine.executor.loader import resolve_model

    directory = tmp_path_factory.mktemp("tiny_compare")
    vocab, hidden, inter, layers, heads, kv_heads = 49152, 32, 64, 2, 2, 1
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
        }
    weights = {name: torch.randn(shape, generator=gen) * 0.2 for name, shape in shapes.items()}
    save_file(weights, str(directory / "model.safetensors"))
    source = resolve_model("smollm2-135m", torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, directory / name)
    return directory


def test_compare_policies_on_the_real_engine(tmp_path: Path, tiny_model_dir: Path) -> None:
    compare = load_script("compare_policies")
    out = tmp_path / "real"
    runs = compare.main(
        [
            "--policies",
            "fcfs",
            "lpm",
            "--real",
            "--set",
            f"model={tiny_model_dir}",
            "dtype=float32",
            "page_size=4",
            "kv_cache_tokens=1024",
            "log_interval=0",
            "--workload",
            "shared_prefix",
            "--workload-arg",
            "num_groups=2",
            "questions_per_group=4",
            "prefix_len=24",
            "output_len=5",
            "vocab_size=49152",
            "--arrivals",
            "interval:0.01",
            "--out",
            str(out),
            "--no-figures",
        ]
    )
    assert [run.label for run in runs] == ["fcfs", "lpm"]
    for run in runs:
        s = run.summary
        assert (s.num_completed, s.num_failed, s.output_tokens) == (8, 0, 40)
        assert all(len(r.token_times) == 5 for r in run.records)
        assert s.ttft.count == 8 and s.ttft.p50 > 0 and s.itl.count == 8 * 4
        # real time decides how much sharing happens; the bound and the bookkeeping do not
        assert 0 <= s.cache_hit_rate <= run.optimal_hit_rate + 1e-12
    details = json.loads((out / "summary.json").read_text())
    for run in runs:
        engine_stats = details[run.label]["engine_stats"]
        assert engine_stats["hit_tokens"] == run.summary.cached_tokens  # warm-up hits reset
        assert engine_stats["policy"] == run.policy
        # the warm-up request counts nowhere: not as a finished request, nor as a tenant's
        assert engine_stats["finished_length"] == 8 and engine_stats["generated_tokens"] == 40
        assert engine_stats["prompt_tokens"] == run.summary.prompt_tokens
        assert list(engine_stats["tenants"]) == [""]  # the workload's requests name none
        assert engine_stats["tenants"][""]["requests"] == 8
    assert "real engine" in (out / "results.md").read_text()


def test_compare_policies_closed_loop_states_the_working_set_and_that_outputs_agree(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    compare = load_script("compare_policies")
    out = tmp_path / "closed"
    runs = compare.main(
        [
            "--policies",
            "fcfs",
            "--real",
            "--closed-loop",
            "2",
            "--set",
            f"model={tiny_model_dir}",
            "dtype=float32",
            "page_size=4",
            "kv_cache_tokens=128",
            "swap_space_bytes=1048576",
            "log_interval=0",
            "--sweep",
            "host_kv_tier=false,true",
            "--workload",
            "multi_turn",
            "--workload-arg",
            "num_conversations=5",
            "num_turns=3",
            "system_len=16",
            "user_median=16",
            "max_user_len=24",
            "output_len=5",
            "vocab_size=49152",
            "--out",
            str(out),
            "--no-figures",
        ]
    )
    assert [run.summary.num_completed for run in runs] == [15, 15]
    report = (out / "results.md").read_text()
    assert "closed loop: 5 conversations, 2 turns in flight, think time 0 s" in report
    assert "x the pool of 128 tokens" in report
    assert "greedy outputs across the 2 run(s): identical (15 answers)" in report
    assert "TTFT p50, all turns (later turns): fcfs host_kv_tier=False: " in report
    details = json.loads((out / "summary.json").read_text())
    plain, tiered = (details[run.label] for run in runs)
    assert plain["outputs"] == tiered["outputs"]
    assert tiered["engine_stats"]["host_hit_tokens"] > 0
    assert plain["engine_stats"]["host_hit_tokens"] == 0
    with pytest.raises(SystemExit, match="add --real"):
        compare.main(["--policies", "fcfs", "--closed-loop", "2", "--workload", "multi_turn",
                      "--out", str(tmp_path / "sim")])  # fmt: skip
