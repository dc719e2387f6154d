"""vLLM's CPU build as the LoRA peer: the spec names the adapters and each request's adapter,
the peer runner refuses a spec that does not add up, and bench_lora runs the peer (a stand-in
venv here) over the same prompts and adapters as the engine, beside it in one table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from tests.scripts.test_compare_policies import load_script
from tests.server_support import tiny_model_dir

# answers like peers/vllm/runner.py: the spec kept beside the result, tokens all 7
FAKE_PEER = """
import json, sys
args = sys.argv[2:]
spec = json.load(open(args[0]))
out = args[args.index("--out") + 1]
json.dump({
    "seconds": 2.0, "seconds_each": [2.0] * spec.get("repeats", 1), "cpu_seconds": 3.0,
    "output_tokens_per_second": sum(r["output_len"] for r in spec["requests"]) / 2.0,
    "vllm_version": "0.32.0", "foreign_cpu_fraction": 0.0, "engine": {"max_loras": 8},
    "token_ids": [[7] * r["output_len"] for r in spec["requests"]],
}, open(out, "w"))
"""


@pytest.fixture
def fake_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    venv = tmp_path / "fake-venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "fake_peer.py").write_text(FAKE_PEER)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake_peer.py"} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("VLLM_VENV", str(venv))
    return venv


def adapter_dir(root: Path, name: str) -> str:
    (root / name).mkdir(parents=True)
    (root / name / "adapter_config.json").write_text("{}")
    return str(root / name)


def test_the_spec_names_the_adapters_and_each_requests_adapter(tmp_path: Path) -> None:
    launcher = load_script("peers/vllm/launcher")
    loras = {"a": tmp_path / "a", "b": tmp_path / "b"}
    spec = launcher.offline_spec(
        [([1, 2], 3), ([4], 5), ([6], 1)],
        tmp_path,
        "bfloat16",
        1024,
        [("max_loras", 2), ("max_lora_rank", 16), ("repeats", 3), ("max_cpu_loras", 2)],
        loras=loras,
        adapters=["b", None, "a"],
    )
    assert spec["loras"] == {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    assert [r.get("lora") for r in spec["requests"]] == ["b", None, "a"]
    assert (spec["max_loras"], spec["max_lora_rank"], spec["repeats"]) == (2, 16, 3)
    assert spec["max_cpu_loras"] == 2 and "llm_kwargs" not in spec  # all runner keys
    with pytest.raises(ValueError, match="not in loras: c"):
        launcher.offline_spec([([1], 1)], tmp_path, "bfloat16", 1, loras=loras, adapters=["c"])
    with pytest.raises(ValueError, match="2 adapter names for 1 requests"):
        launcher.offline_spec([([1], 1)], tmp_path, "bfloat16", 1, loras=loras, adapters=["a", "b"])
    plain = launcher.offline_spec([([1], 1)], tmp_path, "bfloat16", 1)
    assert "loras" not in plain and "lora" not in plain["requests"][0]


def test_the_peer_runner_refuses_adapters_that_do_not_add_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = load_script("peers/vllm/runner")
    good = adapter_dir(tmp_path, "a")
    spec = {
        "model": str(tmp_path),
        "loras": {"a": good},
        "requests": [{"prompt_ids": [1], "output_len": 2, "lora": "a"}],
    }
    runner.validate_spec(spec)  # passes
    cases = [
        ({**spec, "loras": {"a": str(tmp_path / "missing")}}, "has no adapter_config.json"),
        (
            {**spec, "requests": [{"prompt_ids": [1], "output_len": 2, "lora": "z"}]},
            "adapter 'z' is not in the spec's \"loras\"",
        ),
        ({**spec, "repeats": 0}, '"repeats" must be >= 1'),
    ]
    for bad, message in cases:
        with pytest.raises(SystemExit):
            runner.validate_spec(bad)
        assert message in capsys.readouterr().err


def test_bench_lora_runs_the_peer_on_the_same_mix_beside_the_engine(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, fake_venv: Path
) -> None:
    bench = load_script("bench_lora")
    model = tiny_model_dir(tmp_path_factory)
    out = tmp_path / "lora.json"
    result = bench.main(
        [
            "--model", str(model), "--dtype", "float32", "--adapters", "3", "--rank", "4",
            "--targets", "q_proj,v_proj", "--requests", "6", "--concurrency", "4",
            "--prompt-len", "8", "--output-len", "4", "--single-output-len", "4",
            "--repeats", "2", "--no-hf", "--vllm", "--vllm-workdir", str(tmp_path / "v"),
            "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out),
        ]
    )  # fmt: skip
    spec = json.loads((tmp_path / "v" / "vllm_lora_spec.json").read_text())
    drawn = argparse.Namespace(seed=0, requests=6, prompt_len=8, zipf=1.0)
    prompts, picks = bench.workload(drawn, ["lora0", "lora1", "lora2"])
    assert sorted(spec["loras"]) == ["lora0", "lora1", "lora2"]
    assert all(Path(p, "adapter_config.json").is_file() for p in spec["loras"].values())
    assert [r["lora"] for r in spec["requests"]] == picks  # the engine's requests, in order
    assert [r["prompt_ids"] for r in spec["requests"]] == prompts
    assert all(r["output_len"] == 4 for r in spec["requests"])
    assert (spec["max_loras"], spec["max_lora_rank"], spec["max_num_seqs"]) == (3, 4, 4)
    assert spec["repeats"] == 2 and spec["enable_prefix_caching"] is False
    assert spec["dtype"] == "float32" and spec["model"] == str(model)
    assert result["vllm_output_tok_s"] == pytest.approx(6 * 4 / 2.0)
    assert result["vs_vllm"] == pytest.approx(result["mix_output_tok_s"] / 12.0)
    # the stand-in writes 7s: it agrees with ours only where ours wrote 7 too
    assert 0.0 <= result["vllm_agreement_with_ours"]["mean_prefix_fraction"] <= 1.0
    saved = json.loads(out.read_text())
    assert saved["vs_vllm"] == pytest.approx(result["vs_vllm"]) and "outputs" not in saved


def test_the_vllm_lock_is_held_while_the_peer_runs_and_only_then(tmp_path: Path) -> None:
    import fcntl

    bench = load_script("bench_lora")
    lock = tmp_path / "big.lock"

    def free() -> bool:
        with open(lock, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(other, fcntl.LOCK_UN)
            return True

    with bench.exclusive_lock(lock):
        assert not free()
    assert free()
    with bench.exclusive_lock(None):  # no lock asked for: nothing held
        pass
