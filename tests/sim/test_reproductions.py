"""Reproductions of published results: the registry, the page they write, their measures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from asyncengine.sim.reproductions import REPRODUCTIONS, Claim, Outcome, register
from asyncengine.sim.reproductions.document import update_page, write
from asyncengine.sim.reproductions.hol_skip import short_and_long
from asyncengine.sim.reproductions.vtc import ServiceMeter, two_clients
from tests.scripts.test_bench_scripts import load_script


class Dummy:
    name = "dummy"
    title = "A dummy result"
    claim = Claim("Something holds.", "Someone, 2024", "https://example.org")

    def __init__(self, value: int = 1) -> None:
        self.value = value

    def run(self, real: bool) -> Outcome:
        table = "| a | b |\n|---|---:|\n| x | " + str(self.value) + " |\n"
        return Outcome("our setting", table, "it holds", True, {"value": self.value, "real": real})


def test_the_registry_has_the_issue_reproductions() -> None:
    assert {"vtc", "hol-skip", "sarathi-chunks"} <= set(REPRODUCTIONS)
    for name, reproduction in REPRODUCTIONS.items():
        assert reproduction.name == name and reproduction.claim.url.startswith("https://")
    with pytest.raises(ValueError, match="already registered"):
        register(REPRODUCTIONS["vtc"])


def test_a_section_is_replaced_in_place_and_the_others_are_kept(tmp_path: Path) -> None:
    page = tmp_path / "REPRODUCTIONS.md"
    update_page(page, "one", "first text\n")
    update_page(page, "two", "second text\n")
    update_page(page, "one", "first, rewritten\n")
    content = page.read_text()
    assert content.startswith("# Published scheduling results")
    assert "first text" not in content and "first, rewritten" in content
    assert content.index("first, rewritten") < content.index("second text")
    assert content.count("<!-- reproduction: one -->") == 1


def test_a_simulated_run_keeps_the_real_numbers_of_an_earlier_run(tmp_path: Path) -> None:
    page, json_dir = tmp_path / "R.md", tmp_path / "json"
    write(cast(Any, Dummy(7)), "real", Dummy(7).run(True), page, json_dir)
    path = write(cast(Any, Dummy(3)), "sim", Dummy(3).run(False), page, json_dir)
    data = json.loads(path.read_text())
    assert data["runs"]["real"]["numbers"] == {"value": 7, "real": True}
    assert data["runs"]["sim"]["numbers"] == {"value": 3, "real": False}
    content = page.read_text()
    assert "In the simulator: the claim holds" in content
    assert "On the real engine" in content and "| x | 7 |" in content and "| x | 3 |" in content


def test_the_page_names_no_commit_and_the_json_keeps_it(tmp_path: Path) -> None:
    """Which code made a run is provenance for the JSON; the page leaves history to git."""
    page, json_dir = tmp_path / "R.md", tmp_path / "json"
    path = write(cast(Any, Dummy(3)), "sim", Dummy(3).run(False), page, json_dir)
    assert json.loads(path.read_text())["runs"]["sim"]["commit"]
    headings = [line for line in page.read_text().splitlines() if line.startswith("### ")]
    assert headings == ["### In the simulator: the claim holds"]


def test_service_difference_is_measured_only_while_both_are_backlogged() -> None:
    meter = ServiceMeter(cast(Any, None), cast(Any, None), {})
    meter.samples = [
        (1.0, 0.0, 0.0, True),  # a stretch starts
        (2.0, 10.0, 30.0, True),  # b ahead by 20
        (3.0, 40.0, 30.0, True),  # a ahead by 10: the difference swung by 30
        (4.0, 100.0, 30.0, False),  # a got 60 while b was not backlogged: not counted
        (5.0, 100.0, 50.0, True),  # a new stretch, b ahead by -50
        (6.0, 110.0, 90.0, True),  # -20: a swing of 30 again
    ]
    span, got_a, got_b, worst = meter.backlogged()
    assert span == 3.0
    assert (got_a, got_b) == (50.0, 70.0)
    assert worst == 30.0


def test_the_workloads_have_the_shape_they_say() -> None:
    items = two_clients(1.0, 100.0, 16, 8)
    counts = {c: sum(w.tenant == c for w in items) for c in ("a", "b")}
    assert counts == {"a": 100, "b": 200}
    assert all(len(w.prompt_ids) == 16 and w.output_len == 8 for w in items)
    mixed = short_and_long(2.0, 50.0, 8, 4, 10.0, 100, 4)
    longs = [w for w in mixed if w.rid.startswith("long")]
    assert [w.arrival_time for w in longs] == [10.0, 20.0, 30.0, 40.0]
    assert [w.arrival_time for w in mixed] == sorted(w.arrival_time for w in mixed)


def test_reproduce_lists_and_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script("reproduce")
    script.main(["--list"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in REPRODUCTIONS)
    with pytest.raises(SystemExit):
        script.main(["no-such-result"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vtc", "hol-skip", "sarathi-chunks"])
def test_each_claim_holds_in_the_simulator(name: str, tmp_path: Path) -> None:
    script = load_script("reproduce")
    results = script.main([name, "--page", str(tmp_path / "R.md"), "--json-dir", str(tmp_path)])
    outcome = results[name]["sim"]
    assert outcome.holds, outcome.verdict
    assert f"<!-- reproduction: {name} -->" in (tmp_path / "R.md").read_text()


@pytest.mark.slow
def test_a_reproduction_runs_on_the_real_executor_with_its_step_hook(tmp_path: Path) -> None:
    """The --real path: the real model (a tiny random llama here) on the CPU clock, the
    reproduction's step hook fed every landed step."""
    from asyncengine.common.config import EngineConfig
    from asyncengine.sim.reproductions import run_workload
    from asyncengine.sim.reproductions.vtc import meter_factory
    from tests.sim.test_sim_vs_real import write_model

    model = write_model(tmp_path / "model")
    workload = two_clients(4.0, 3.0, 24, 6, vocab_size=2000)
    meters: list[ServiceMeter] = []
    config = EngineConfig(policy="fair", kv_cache_tokens=2048, max_model_len=512, log_interval=0)
    run = run_workload(
        "fair", config, workload, real=True,
        hook=meter_factory({w.rid: str(w.tenant) for w in workload}, meters),
        real_base=EngineConfig(model=str(model), device="cpu"),
    )  # fmt: skip
    assert run.summary.num_completed == len(workload) and run.steps > 0
    (meter,) = meters
    assert len(meter.samples) == run.steps
    total = 24 * len(workload) + 2 * 6 * len(workload)  # every prompt token, every output token
    assert sum(meter.service.values()) == total
    assert run.stats["policy"] == "fair"
