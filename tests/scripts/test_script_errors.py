"""A user's mistake given to a script is one error line and exit status 2, as from the CLI;
and the loop-side cost benchmark runs (scripts/micro/bench_land.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("bench_simulator.py", ["--policies", "nope", "--num-requests", "5"], "unknown policy"),
        ("compare_policies.py", ["--workload", "nope", "--out", "{out}"], "unknown workload"),
        (
            "compare_policies.py",
            ["--workload", "shared_prefix", "--workload-arg", "num_requests=9", "--out", "{out}"],
            "takes no argument 'num_requests'; its arguments: num_groups, questions_per_group",
        ),
        (
            "compare_policies.py",
            ["--workload", "slo_mix", "--arrivals", "poisson:0.8", "--out", "{out}"],
            "workload 'slo_mix' draws its own arrival times and takes no 'arrivals' (--arrivals): "
            "set its rate instead",
        ),
        ("bench_replicas.py", ["--setups", "nope", "--out", "{out}"], "unknown setups ['nope']"),
    ],
)
def test_a_bad_value_is_one_line(script: str, args: list[str], says: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [arg.format(out=out) for arg in args]
    assert_one_error_line(script, args, says, dict(os.environ))
    assert not out.exists()  # a mistake leaves no output folder behind


def test_a_policy_that_stalls_the_simulator_is_one_line(tmp_path: Path) -> None:
    """compare_policies names the policy and the requests it held, without a traceback."""
    (tmp_path / "holder.py").write_text(
        "from asyncengine.policies.base import Policy\n\n\n"
        "class Holder(Policy):\n"
        "    orders = True\n\n"
        "    def order(self, waiting, ctx):\n"
        "        return []\n"
    )
    args = ["--policies", f"{tmp_path / 'holder.py'}:Holder", "--workload", "random"]
    args += ["--workload-arg", "num_requests=3", "--no-figures", "--out", str(tmp_path / "out")]
    says = "policy 'Holder' admitted nothing for 30"
    assert_one_error_line("compare_policies.py", args, says, dict(os.environ))


def test_a_gpu_dry_run_outside_the_interpreter_is_one_line() -> None:
    """The kernels run on CPU tensors only under TRITON_INTERPRET=1, which must be set before
    Triton loads them: without it the dry run says so instead of failing in the first kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert_one_error_line("check_kernels_gpu.py", ["--cpu-dry-run"], "TRITON_INTERPRET=1", env)


def assert_one_error_line(script: str, args: list[str], says: str, env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: ") and says in lines[0]


def test_bench_land_measures_the_text_share() -> None:
    spec = importlib.util.spec_from_file_location(
        "bench_land", ROOT / "scripts" / "micro" / "bench_land.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (row,) = module.main(["--batches", "4", "--steps", "5", "--repeats", "1", "--step-ms", "50"])
    assert row["batch"] == 4 and row["land_us"] > row["land_without_text_us"] > 0
    assert 0 < row["text_share_of_cpu_step"] < row["land_share_of_cpu_step"] < 1
