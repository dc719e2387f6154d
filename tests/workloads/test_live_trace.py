"""Live traces: recorded from a running engine, read back as the same workload (token ids, or
page hashes that keep the page sharing), replayed under other policies with a cost model
fitted to the same run."""

from __future__ import annotations

import asyncio
import json
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.common.config import EngineConfig
from asyncengine.common.request import choice_rid
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.sim.engine_replay import replay_real
from asyncengine.sim.simulator import simulate
from asyncengine.workloads.live_trace import (
    is_live_trace,
    load_live_trace,
    load_requests,
    page_hashes,
    tokens_of_hashes,
)
from asyncengine.workloads.trace import WorkloadRequest, load_trace, save_trace
from tests.api.test_scheduling_e2e import engine, params, prompt
from tests.scripts.test_compare_policies import load_script
from tests.server_support import engine_config, tiny_model_dir

SHARED = prompt(42, 24)  # six pages of 4 tokens
SWAP_OPTIONS = {"max_wait_tokens": 64}


async def record(path: Path, hashed: bool) -> list[tuple[str, list[int], int]]:
    """Serve a few requests (shared prefixes, tenants, priorities, a timeout) while recording."""
    sent = []
    async with engine(max_running_requests=2) as eng:
        eng.record_trace(str(path), hashed=hashed)
        calls = []
        for k in range(8):
            ids = (SHARED if k % 2 else []) + prompt(k, 5 + k)
            p = params(4 + k, tenant=f"t{k % 3}", priority=k % 2)
            calls.append(eng.generate(ids, p, request_id=f"r{k}"))
            sent.append((f"r{k}", ids, 4 + k))
            await asyncio.sleep(0.003)
        outs = await asyncio.gather(*calls)
        assert all(o.finish_reason == "length" for o in outs)
        # a live swap: the trace says which policy ran which requests
        eng.set_policy("priority", SWAP_OPTIONS)
        late = await eng.generate(prompt(77), params(500, timeout=0.02), request_id="late")
        assert late.finish_reason == "timeout"
        steps = eng.stats()["steps"]
    assert eng.streams.recorder is None  # stopping the engine closed the trace
    sent.append(("late", prompt(77), 500))
    return sent + [("steps", [], steps)]


@pytest.mark.parametrize("hashed", [False, True])
async def test_a_recorded_trace_reads_back_as_the_same_workload(
    tmp_path: Path, hashed: bool
) -> None:
    path = tmp_path / "live.jsonl"
    if hashed:  # a file already there, world readable: the trace takes it over at 0600
        path.write_text("old")
        path.chmod(0o644)
    *sent, (_, _, steps) = await record(path, hashed)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds every prompt: the owner's only
    assert is_live_trace(path)
    trace = load_live_trace(path)
    assert trace.header["page_size"] == 4 and trace.header["hashed"] is hashed
    assert (trace.header["policy"], trace.header["policy_options"]) == ("fcfs", {})
    (swap,) = trace.policy_swaps
    assert (swap.policy, swap.options) == ("priority", SWAP_OPTIONS)
    by_rid = {r.rid: r for r in trace.requests}
    before = [r.arrival_time for r in trace.requests if r.rid != "late"]
    assert max(before) <= swap.time <= by_rid["late"].arrival_time
    assert set(by_rid) == {rid for rid, _, _ in sent}
    arrivals = [r.arrival_time for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    for rid, ids, n in sent:
        item = by_rid[rid]
        assert len(item.prompt_ids) == len(ids)
        if not hashed:
            assert item.prompt_ids == ids
        if rid == "late":  # timed out: the replay asks for what it asked for
            assert item.output_len == n and item.timeout == pytest.approx(0.02)
            assert trace.finish_reasons[rid] == "timeout"
        else:
            k = int(rid[1:])
            assert item.output_len == n and item.tenant == f"t{k % 3}" and item.priority == k % 2
    # the prefix cache sees the same sharing: the same best hits, page by page
    original = [ids for _, ids, _ in sent]
    replayed = [by_rid[rid].prompt_ids for rid, _, _ in sent]
    assert optimal_hit(replayed, 4) == optimal_hit(original, 4)
    if hashed:
        text = path.read_text()
        assert (
            "prompt_ids" not in text
            and json.dumps(SHARED[:4], separators=(",", ":"))[1:-1] not in text
        )
    assert 0 < len(trace.steps) <= steps
    assert sum(s.prefill_tokens for s in trace.steps) >= sum(len(ids) for ids in original) // 2
    assert all(s.seconds > 0 for s in trace.steps)


def test_page_hashes_are_chained_and_rebuilt_pages_shared_exactly() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [1, 2, 3, 4, 5, 6, 7, 0, 9, 9]
    ha, hb = page_hashes(a, 4), page_hashes(b, 4)
    assert len(ha) == 2 and len(hb) == 2 and ha[0] == hb[0] and ha[1] != hb[1]
    assert page_hashes([9, 9, 9, 9, 1, 2, 3, 4], 4)[1] != page_hashes([1, 2, 3, 4], 4)[0]
    ta = tokens_of_hashes(ha, 9, 4, 1000, "a")
    tb = tokens_of_hashes(hb, 10, 4, 1000, "b")
    assert ta[:4] == tb[:4] and ta[4:8] != tb[4:8] and len(ta) == 9 and len(tb) == 10
    with pytest.raises(ValueError):
        tokens_of_hashes(ha, 20, 4, 1000, "a")


def test_workload_traces_carry_the_scheduling_controls(tmp_path: Path) -> None:
    items = [
        WorkloadRequest("a", 0.0, [1, 2], 3, priority=-2, tenant="x", timeout=1.5),
        WorkloadRequest("b", 0.5, [3], 1),
    ]
    save_trace(tmp_path / "w.jsonl", items)
    assert load_trace(tmp_path / "w.jsonl") == items == load_requests(tmp_path / "w.jsonl")
    assert not is_live_trace(tmp_path / "w.jsonl")


async def test_compare_policies_replays_a_live_trace_with_a_fitted_cost_model(
    tmp_path: Path,
) -> None:
    path = tmp_path / "live.jsonl"
    *sent, _ = await record(path, hashed=True)
    compare = load_script("compare_policies")
    out = tmp_path / "out"
    runs = compare.main(
        [
            "--trace", str(path), "--fit-from-trace",
            "--policies", "fcfs", "priority", "fair",
            "--set", "page_size=4", "kv_cache_tokens=1024", "max_model_len=600",
            "--group-by", "tenant", "priority",
            "--slo", "ttft_ms=1000", "tpot_ms=1000",
            "--out", str(out), "--no-figures",
        ]
    )  # fmt: skip
    assert [r.label for r in runs] == ["fcfs", "priority", "fair"]
    for run in runs:
        assert run.summary.num_requests == 9
        assert run.summary.num_completed + run.summary.num_timed_out == 9
        # the timed-out request's prompt counts in the hit rate as in its bound
        assert run.summary.prompt_tokens == sum(len(ids) for _, ids, _ in sent)
        assert 0 < run.summary.cache_hit_rate <= run.optimal_hit_rate
    fitted = json.loads((out / "cost_model.json").read_text())
    assert "fitted to" in fitted["description"] and fitted["intercept"] >= 0
    results = (out / "results.md").read_text()
    assert "## By tenant" in results and "| fair | tenant t1 |" in results
    assert "SLO met" in results
    with pytest.raises(SystemExit):
        compare.main(["--workload", "random", "--fit-from-trace", "--policies", "fcfs",
                      "--out", str(out)])  # fmt: skip


def write_steps(path: Path, seconds: list[float], decodes: list[int]) -> Path:
    """A live trace of decode steps only: ``decodes[i]`` requests took ``seconds[i]``."""
    lines = [{"type": "header", "version": 1, "page_size": 4, "vocab_size": 100}]
    lines += [
        {"type": "step", "time": float(i), "seconds": s, "prefill_tokens": 0,
         "prefill_attention": 0, "decode_requests": n, "decode_context": 10 * n}
        for i, (s, n) in enumerate(zip(seconds, decodes, strict=True))
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_fit_from_trace_reports_its_error_and_warns_on_a_poor_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    compare = load_script("compare_policies")
    decodes = [1, 2, 3, 4] * 5
    linear = write_steps(tmp_path / "linear.jsonl", [0.01 + 0.002 * n for n in decodes], decodes)
    model = compare.trace_cost_model(str(linear), tmp_path)
    out, err = capsys.readouterr()
    assert "median 0.0%" in model.description and "(1.00x)" in out
    assert "warning" not in err
    # the same steps, every other one 10x slower: no model of these features can follow
    slow = [(0.01 + 0.002 * n) * (10 if i % 2 else 1) for i, n in enumerate(decodes)]
    noisy = write_steps(tmp_path / "noisy.jsonl", slow, decodes)
    model = compare.trace_cost_model(str(noisy), tmp_path)
    out, err = capsys.readouterr()
    assert "warning: the fitted cost model misses the trace's own steps by more than 25%" in err
    saved = json.loads((tmp_path / "cost_model.json").read_text())
    assert saved["description"] == model.description and "p90" in saved["description"]


SALTED = [  # (request id, prompt seed, cache salt, choices), served one after the other
    ("a1", 1, "a", 1),
    ("b1", 1, "b", 1),  # the same prompt in another namespace: no hit live, none in replay
    ("a2", 1, "a", 1),
    ("base", 1, None, 1),
    ("fan", 2, "a", 3),  # three choices fork one prefill
]


async def record_salted(path: Path, hashed: bool) -> dict[str, int]:
    """Serve SALTED while recording; the cached tokens of each choice, by its engine id."""
    cached: dict[str, int] = {}
    async with engine() as eng:
        eng.record_trace(str(path), hashed=hashed)
        for rid, seed, salt, n in SALTED:
            p = SamplingParams(
                max_new_tokens=3, temperature=0, cache_salt=salt, n=n, ignore_eos=True
            )
            outs = await eng.generate_choices(SHARED + prompt(seed, 6), p, request_id=rid)
            assert len(outs) == n
            for i, out in enumerate(outs):
                cached[choice_rid(rid, n, i)] = out.usage.cached_tokens
    return cached


@pytest.mark.parametrize("hashed", [False, True])
async def test_a_replay_keeps_each_requests_cache_salt_and_choices(
    tmp_path: Path, hashed: bool
) -> None:
    path = tmp_path / "live.jsonl"
    served = await record_salted(path, hashed)
    assert served["b1"] == 0 and served["a2"] > 0 and served["base"] == 0
    assert served["fan-1"] > served["fan-0"] > 0  # choices 1.. fork choice 0's prompt pages
    text = path.read_text()
    assert ('"cache_salt":"a"' in text) is not hashed  # a hashed trace keeps salts' digests
    trace = load_live_trace(path)
    by_rid = {r.rid: r for r in trace.requests}
    assert set(by_rid) == {rid for rid, *_ in SALTED}  # one arrival per request, not per choice
    assert by_rid["fan"].n == 3 and by_rid["fan"].output_len == 3
    assert by_rid["a1"].cache_salt == by_rid["a2"].cache_salt != by_rid["b1"].cache_salt
    assert by_rid["base"].cache_salt is None
    # far apart: each request finds the cache as its predecessors left it, as live
    spaced = [replace(r, arrival_time=10.0 * k) for k, r in enumerate(trace.requests)]
    config = EngineConfig.from_dict({"page_size": 4, "kv_cache_tokens": 1024})
    records = simulate(config, spaced).records
    assert {r.rid: r.cached_tokens for r in records} == served
    assert all(r.output_tokens == 3 for r in records)


def test_an_old_trace_without_salts_or_choices_loads(tmp_path: Path) -> None:
    """Version 1 wrote an arrival per choice and a salt only among the params."""
    lines = [
        {"type": "header", "version": 1, "page_size": 4, "vocab_size": 100, "hashed": False},
        {"type": "arrival", "rid": "x-0", "time": 0.0, "prompt_ids": [1, 2, 3],
         "params": {"max_new_tokens": 5, "n": 2, "cache_salt": "s"}, "tenant": None,
         "priority": 0, "timeout": None},
        {"type": "arrival", "rid": "x-1", "time": 0.0, "prompt_ids": [1, 2, 3],
         "params": {"max_new_tokens": 5, "n": 2, "cache_salt": "s"}, "tenant": None,
         "priority": 0, "timeout": None},
        {"type": "arrival", "rid": "y", "time": 0.5, "prompt_ids": [4],
         "params": {"max_new_tokens": 2}, "tenant": "t", "priority": 1, "timeout": None},
        {"type": "finish", "rid": "x-0", "time": 1.0, "output_tokens": 4,
         "finish_reason": "stop", "cached_tokens": 0},
    ]  # fmt: skip
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = load_requests(path)
    assert [(r.rid, r.n, r.cache_salt, r.output_len) for r in requests] == [
        ("x-0", 1, "s", 4),
        ("x-1", 1, "s", 5),
        ("y", 1, None, 2),
    ]
    assert requests[2].tenant == "t" and requests[2].priority == 1


def test_workload_traces_carry_salts_and_choices(tmp_path: Path) -> None:
    items = [
        WorkloadRequest("a", 0.0, [1, 2], 3, cache_salt="s", n=4),
        WorkloadRequest("b", 1, [3], 1),
    ]
    save_trace(tmp_path / "w.jsonl", items)
    assert load_trace(tmp_path / "w.jsonl") == items
    assert items[0].choice_rids == ["a-0", "a-1", "a-2", "a-3"] and items[1].choice_rids == ["b"]
    bad = {"rid": "c", "arrival_time": 0.0, "prompt_ids": [1], "output_len": 1, "n": 0}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="n must be a whole number >= 1"):
        load_trace(tmp_path / "bad.jsonl")


async def test_the_real_engine_replays_salts_and_choices(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = engine_config(tiny_model_dir(tmp_path_factory), page_size=4)
    ids = prompt(5, 30)
    workload = [  # apart, so each finds the cache its predecessors left
        WorkloadRequest("a1", 0.0, ids, 3, cache_salt="a"),
        WorkloadRequest("b1", 0.5, ids, 3, cache_salt="b"),
        WorkloadRequest("fan", 1.0, ids, 3, cache_salt="b", n=3),
    ]
    outputs: dict[str, list[int]] = {}
    records, _ = await replay_real(config, workload, outputs=outputs)
    by_rid = {r.rid: r for r in records}
    assert list(by_rid) == ["a1", "b1", "fan-0", "fan-1", "fan-2"]
    assert by_rid["b1"].cached_tokens == 0  # another namespace than a1's
    # each choice is its own output, and the later ones fork choice 0's prompt pages
    assert all(len(outputs[rid]) == 3 for rid in by_rid)
    assert by_rid["fan-1"].cached_tokens >= 28 and by_rid["fan-2"].cached_tokens >= 28
