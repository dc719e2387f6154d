#!/usr/bin/env python
"""Compare engine configurations (policies) on one workload: a markdown table and figures.

    python scripts/compare_policies.py --configs configs/fcfs.toml configs/lpm.toml \
        --workload shared_prefix --arrivals poisson:20 --sim --out results/prefix
    python scripts/compare_policies.py --policies fcfs lpm dfs-weight --workload trace.jsonl --out DIR

    python scripts/compare_policies.py --policies lpm --workload shared_prefix \
        --sweep replicas=1,2 router=cache-aware,round-robin --ray --out results/routers
    python scripts/compare_policies.py --trace live.jsonl --fit-from-trace \
        --policies fcfs lpm sjf --out DIR      # yesterday's traffic under other policies

``--workload`` is a generator name (see asyncengine.workloads.WORKLOADS; its arguments go in
``--workload-arg key=value``) or a JSONL trace. ``--trace`` is a live trace written by
``asyncengine serve --record-trace`` (or a workload trace); ``--fit-from-trace`` fits the
simulator's cost model to the steps measured in that same live run. ``--sim`` (the default)
drives the real scheduler with a cost model on a virtual clock; ``--real`` runs the model.
``--shadow`` also runs each config's ``shadow_policy`` as the live one (the full picture behind
the shadow's agreement figures). ``--group-by tenant|priority|lora`` adds per-group tables and a
figure; ``--slo ttft_ms=N tpot_ms=N`` adds SLO attainment and goodput.

DIR receives results.md, summary.json, workload.jsonl, ttft_cdf.png, itl_p99.png,
hit_rate.png where the workload shares a prefix (and ttft_by_GROUP.png, cost_model.json where
asked). The table shows each run's
hit rate next to the offline bounds with an infinite pool, with the run's pool, and with the
run's pool in arrival order (asyncengine/bench/optimal_hit_finite.py; one-replica runs).

``--eviction lru,lfu,arc,queue-aware,cost-aware`` runs every configuration under each eviction
rule and adds a table of each rule's hit tokens next to Belady's bound on the same pool (the best
eviction for the arrival order) and their gain over the same configuration's lru run
(asyncengine/bench/eviction_table.py); a rule of one's own is named as for --eviction-policy.

``--sweep KEY=V1,V2,...`` (repeatable) runs every configuration at every point of the grid
(a value is JSON where it parses, a JSON object one value, commas and all:
``'policy_options={"aging":0.5,"max_wait_tokens":1000},{"aging":1.0}'``); KEY is an engine
config key, or ``replicas``/``router`` for the simulator's multi-replica mode (N simulated
engines behind one of the Ray deployment's routers; ``--replicas``/``--router`` set them for
every run). ``--ray [ADDR]`` runs the simulations as Ray tasks, on a local Ray
(no ADDR) or a cluster (ADDR, e.g. ``auto``); the results are the same as a local run's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.bench.eviction_table import EvictionRow, eviction_table
from asyncengine.bench.groups import SLO
from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.bench.optimal_hit_finite import optimal_hit_finite
from asyncengine.bench.percentiles import percentiles
from asyncengine.bench.records import BenchSummary, RequestRecord, summarize
from asyncengine.bench.report import (
    RunReport,
    blocked_table,
    failure_note,
    group_table,
    markdown_table,
    predictor_table,
    queue_hint,
    shadow_table,
    write_figures,
    write_group_figure,
)
from asyncengine.common.config import EngineConfig, key_value
from asyncengine.policies.eviction_registry import resolve_eviction_rule
from asyncengine.policies.registry import build_policy
from asyncengine.script_main import run_main
from asyncengine.sim.sweep import JOB_KEYS, SimJob, expand, parse_sweep, run_jobs
from asyncengine.workloads import Arrivals, make_workload, save_trace
from asyncengine.workloads.live_trace import is_live_trace, load_requests
from asyncengine.workloads.trace import WorkloadRequest


def load_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    extra = dict(args.workload_arg)
    source = args.trace or args.workload
    if args.trace or source.endswith(".jsonl") or Path(source).is_file():
        if extra or args.arrivals:
            raise SystemExit(
                "--workload-arg and --arrivals apply to generated workloads, not traces"
            )
        return load_requests(source)
    if args.arrivals:
        extra["arrivals"] = Arrivals.parse(args.arrivals)
    return make_workload(source, seed=args.seed, **extra)


def trace_cost_model(path: str, out: Path) -> Any:
    """The cost model fitted to the steps a live trace measured (saved to out/cost_model.json),
    with how far it is from those steps; a warning when that is past POOR_FIT_ERROR."""
    from dataclasses import replace

    from asyncengine.sim.cost_model import POOR_FIT_ERROR, CostModel, live_trace_steps

    if not is_live_trace(path):
        raise SystemExit(f"--fit-from-trace needs a live trace (serve --record-trace), not {path}")
    try:
        model = CostModel.from_live_trace(path)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    error = model.fit_error(*live_trace_steps(path))
    model = replace(model, description=f"{model.description} ({error.describe()})")
    model.save(out / "cost_model.json")
    print(f"cost model {model.description}", flush=True)
    if error.poor:
        print(
            f"warning: the fitted cost model misses the trace's own steps by more than "
            f"{POOR_FIT_ERROR:.0%} (median step {error.median:.1%}, all steps {error.total:.1%}): "
            "simulated latencies will be off by about as much. The steps' time depends on "
            "something the model's features (prefill tokens, attention, decodes, decoded KV) "
            "do not see, or the machine's load changed during the recording.",
            file=sys.stderr,
            flush=True,
        )
    return model


def build_configs(args: argparse.Namespace) -> list[tuple[str, EngineConfig]]:
    overrides = dict(args.set)
    configs: list[tuple[str, EngineConfig]] = []
    for path in args.configs:
        configs.append((Path(path).stem, EngineConfig.from_toml(path, **overrides)))
    for policy in args.policies:
        config = EngineConfig.from_toml(args.base_config, policy=policy, **overrides)
        # a policy of one's own goes by its name, as in the engine's stats; built-ins by spec
        label = build_policy(policy, config.policy_options).name if ":" in policy else policy
        configs.append((label, config))
    if not configs:
        raise SystemExit("give --configs and/or --policies")
    if args.shadow:  # each shadow as the live policy, right after its config
        with_shadows = []
        for label, config in configs:
            with_shadows.append((label, config))
            if config.shadow_policy is not None:
                as_live = config.replace(
                    policy=config.shadow_policy,
                    policy_options=config.shadow_policy_options,
                    shadow_policy=None,
                    shadow_policy_options={},
                )
                with_shadows.append((f"{label} shadow: {config.shadow_policy}", as_live))
        configs = with_shadows
    seen: dict[str, int] = {}
    labelled = []
    for label, config in configs:
        seen[label] = seen.get(label, 0) + 1
        labelled.append((label if seen[label] == 1 else f"{label}#{seen[label]}", config))
    return labelled


def with_rule_names(jobs: list[SimJob], eviction: str) -> list[SimJob]:
    """A rule from a file or module goes by its ``name`` in the runs' labels (tables,
    figures), as a policy of one's own does; by its spec where another rule has that name."""
    specs = [spec.strip() for spec in eviction.split(",")]
    names = {spec: resolve_eviction_rule(spec).name for spec in specs if ":" in spec}
    shown = [names.get(spec, spec) for spec in specs]
    named = []
    for job in jobs:
        label = job.label
        for spec, name in names.items():
            suffix = f" eviction_policy={spec}"  # the sweep's last axis
            if label.endswith(suffix) and shown.count(name) == 1:
                label = f"{label[: -len(suffix)]} eviction_policy={name}"
        named.append(dataclasses.replace(job, label=label))
    return named


def run_one(
    config: EngineConfig, workload: list[WorkloadRequest], args: argparse.Namespace
) -> tuple[list[RequestRecord], BenchSummary, dict[str, Any]]:
    """Run one configuration on the real engine; its records, their summary and its stats."""
    from asyncengine.sim.engine_replay import replay_real

    closed: dict[str, Any] = {}
    if args.closed_loop:
        from asyncengine.sim.closed_loop import conversations_of, replay_closed_loop

        run = asyncio.run(
            replay_closed_loop(
                config, conversations_of(workload), args.closed_loop, args.think_time
            )
        )
        records, stats = run.records, run.stats
        closed = {"closed_loop": {"prompts": run.prompts, "outputs": run.outputs}}
    else:
        outputs: dict[str, list[int]] = {}
        records, stats = asyncio.run(replay_real(config, workload, outputs=outputs))
        closed = {"outputs": outputs}
    retracts = stats.get("retractions")
    summary = summarize(records, retracts=None if retracts is None else int(retracts))  # type: ignore[call-overload]
    details = {
        "engine_stats": stats,
        "pages_total": stats["pages_total"],
        "admission_blocked": stats.get("admission_blocked"),
        "shadow": stats.get("shadow"),
        **closed,
    }
    return records, summary, details


def closed_loop_report(
    workload: list[WorkloadRequest],
    jobs: list[SimJob],
    results: list[tuple[list[RequestRecord], BenchSummary, dict[str, Any]]],
    args: argparse.Namespace,
) -> tuple[str, bool, dict[str, list[int]]]:
    """The closed loop's note (working set against the pool, whether every run gave the same
    answers), whether they differ, and the first run's prompts as sent."""
    from asyncengine.sim.closed_loop import conversations_of, outputs_agree

    conversations = conversations_of(workload)
    working_set = sum(c.final_context for c in conversations)
    pools = sorted(
        {
            int(e["pages_total"]) * j.config.page_size
            for j, (_, _, e) in zip(jobs, results, strict=True)
        }
    )
    ratios = ", ".join(f"{working_set / pool:.1f}x the pool of {pool} tokens" for pool in pools)
    loops = [extra.pop("closed_loop") for _, _, extra in results]
    for loop, (_, _, extra) in zip(loops, results, strict=True):
        extra["outputs"] = loop["outputs"]
    agree = outputs_agree([loop["outputs"] for loop in loops])
    later = {t.rid for c in conversations for t in c.turns[1:]}
    ttfts = []
    for job, (records, summary, _) in zip(jobs, results, strict=True):
        resumed = [
            r.token_times[0] - r.arrival_time
            for r in records
            if r.completed and r.token_times and r.rid in later
        ]
        p50 = percentiles(resumed, [50])[0] if resumed else float("nan")
        ttfts.append(f"{job.label}: {summary.ttft.p50 * 1e3:.0f} ms ({p50 * 1e3:.0f} ms)")
    note = (
        f"closed loop: {len(conversations)} conversations, {args.closed_loop} turns in flight, "
        f"think time {args.think_time:g} s; each turn is the previous prompt + the engine's own "
        f"answer + the next message. Working set (every conversation's last prompt and answer): "
        f"{working_set} tokens, {ratios}. The hit bounds are of these prompts with the "
        "first run's answers cached, as the engine caches them for the next turn.\n\n"
        f"greedy outputs across the {len(loops)} run(s): {agree}\n\n"
        f"TTFT p50, all turns (later turns): {'; '.join(ttfts)}"
    )
    return note, not agree.startswith("identical"), loops[0]["prompts"]


def main(argv: Sequence[str] | None = None) -> list[RunReport]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="*", default=[], help="engine config TOML files")
    parser.add_argument("--policies", nargs="*", default=[], help="policy specs over --base-config")
    parser.add_argument(
        "--base-config", default=None, help="TOML the --policies entries start from"
    )
    parser.add_argument(
        "--set",
        nargs="*",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="override every config",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", help="generator name or trace.jsonl")
    source.add_argument("--trace", help="a live trace (serve --record-trace) or a workload trace")
    parser.add_argument(
        "--fit-from-trace",
        action="store_true",
        help="simulate with a cost model fitted to the live trace's measured steps",
    )
    parser.add_argument(
        "--shadow", action="store_true", help="also run each config's shadow_policy as live"
    )
    parser.add_argument(
        "--group-by",
        nargs="*",
        choices=("tenant", "priority", "lora"),
        default=[],
        help="per-tenant / per-priority / per-adapter tables and TTFT figures",
    )
    parser.add_argument(
        "--slo",
        nargs="*",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="SLO targets ttft_ms=N tpot_ms=N: attainment and goodput columns",
    )
    parser.add_argument(
        "--workload-arg", nargs="*", type=key_value, default=[], metavar="KEY=VALUE"
    )
    parser.add_argument("--arrivals", default=None, help="burst | poisson:RATE | interval:SECONDS")
    parser.add_argument("--seed", type=int, default=0)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sim", action="store_true", help="simulate (default)")
    mode.add_argument("--real", action="store_true", help="run the real engine")
    parser.add_argument("--cost-model", default=None, help="cost model JSON for --sim")
    parser.add_argument(
        "--closed-loop",
        type=int,
        default=0,
        metavar="N",
        help="--real chat as a client sends it: a conversation's next turn after its last "
        "finished, with the engine's own answer; N turns in flight (asyncengine/sim/closed_loop.py)",
    )
    parser.add_argument(
        "--think-time", type=float, default=0.0, help="--closed-loop: seconds between turns"
    )
    parser.add_argument(
        "--sweep", nargs="*", default=[], metavar="KEY=V1,V2", help="a grid of settings"
    )
    parser.add_argument(
        "--eviction",
        default=None,
        metavar="RULE,RULE",
        help="eviction rules to run every config under (lru,lfu,arc,queue-aware,cost-aware): "
        "adds a table against Belady's bound",
    )
    parser.add_argument("--replicas", type=int, default=1, help="simulated replicas per run")
    parser.add_argument("--router", default=None, help="router of the replicas (cache-aware)")
    parser.add_argument(
        "--router-option", nargs="*", type=key_value, default=[], metavar="KEY=VALUE"
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDR",
        help="run the simulations as Ray tasks (a local Ray, or the cluster at ADDR)",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args(argv)

    logging.getLogger("asyncengine.scheduler.scheduler").setLevel(
        logging.ERROR
    )  # retract notes: counted
    out = Path(args.out)
    if args.fit_from_trace and not args.trace:
        raise SystemExit("--fit-from-trace fits to the live run given with --trace")
    if args.fit_from_trace and args.real:
        raise SystemExit("--fit-from-trace is for the simulator (--sim)")
    if args.cost_model and (args.real or args.fit_from_trace):
        raise SystemExit(
            "--cost-model is the simulator's step cost: not with --real, nor with "
            "--fit-from-trace (which fits one)"
        )
    if args.think_time and not args.closed_loop:
        raise SystemExit(
            "--think-time is the pause between a conversation's turns: add --closed-loop"
        )
    slo = SLO.parse(args.slo) if args.slo else None
    workload = load_workload(args)
    configs = build_configs(args)
    out.mkdir(parents=True, exist_ok=True)  # after the checks: a mistake leaves no folder
    save_trace(out / "workload.jsonl", workload)
    # the bounds see what the prefix cache keys: each choice's prompt, under its salt and adapter
    prompts = [w.cache_ids for w in workload for _ in range(w.n)]
    in_arrival_order = [
        w.cache_ids for w in sorted(workload, key=lambda w: w.arrival_time) for _ in range(w.n)
    ]
    bounds: dict[tuple[str, int, int, int], float] = {}
    # each run's generated tokens, aligned with ``prompts``: later prompts may hit them
    answers: list[list[list[int]]] = []

    def bound(kind: str, page_size: int, pool_pages: int = 0, run: int = 0) -> float:
        """The infinite-pool bound, or with ``pool_pages`` in any order / in arrival order.
        The first two are at token granularity (the engine shares partial pages too) and
        count run ``run``'s answers as cached; the arrival-order one is over whole pages."""
        run = min(run, len(answers) - 1)
        key = (kind, page_size, pool_pages, run)
        if key not in bounds:
            if kind == "infinite":
                bounds[key] = optimal_hit(prompts, 1, answers[run]).rate
            elif not pool_pages:
                bounds[key] = float("nan")  # several replicas: several pools
            elif kind == "pool":
                tokens = pool_pages * page_size
                found = optimal_hit_finite(prompts, 1, tokens, "any", answers[run])
                bounds[key] = found.rate
            else:
                found = optimal_hit_finite(in_arrival_order, page_size, pool_pages, "arrival")
                bounds[key] = found.rate
        return bounds[key]

    if args.eviction:
        args.sweep = [*args.sweep, f"eviction_policy={args.eviction}"]
    belady: dict[tuple[int, int], int] = {}

    def belady_tokens(page_size: int, pool_pages: int) -> int:
        """Belady's hit tokens: the best eviction for the arrival order on this pool."""
        if (page_size, pool_pages) not in belady:
            found = optimal_hit_finite(in_arrival_order, page_size, pool_pages, "arrival")
            belady[page_size, pool_pages] = found.hit_tokens
        return belady[page_size, pool_pages]

    sweep = parse_sweep(args.sweep)
    base = [
        SimJob(label, config, args.replicas, args.router, dict(args.router_option))
        for label, config in configs
    ]
    jobs = expand(base, sweep)
    if args.eviction:
        jobs = with_rule_names(jobs, args.eviction)
    if args.real and (args.ray or any(job.multi_replica for job in jobs)):
        raise SystemExit(
            f"--ray and {'/'.join(JOB_KEYS)} apply to simulated runs; --real runs one engine here"
        )
    if args.closed_loop and not args.real:
        raise SystemExit("--closed-loop runs the real engine: add --real")
    if args.real:
        results = []
        for job in jobs:
            print(f"[{job.label}] policy={job.config.policy} ...", flush=True)
            records, summary, extra = run_one(job.config, workload, args)
            results.append((records, summary, extra))
    closed_note, outputs_differ = "", False
    if args.closed_loop:  # the bounds are of the prompts sent, with the engine's answers
        closed_note, outputs_differ, sent = closed_loop_report(workload, jobs, results, args)
        prompts = list(sent.values())
        answers.append([results[0][2]["outputs"].get(rid, []) for rid in sent])
        in_arrival_order = [
            sent[r.rid] for r in sorted(results[0][0], key=lambda r: r.arrival_time)
        ]
    elif args.real:
        for _, _, extra in results:
            answers.append(
                [extra["outputs"].get(rid, []) for w in workload for rid in w.choice_rids]
            )
    if not args.real:
        from asyncengine.sim.cost_model import CostModel
        from asyncengine.sim.simulated_executor import SAMPLED_TOKEN_ID

        answers.append([[SAMPLED_TOKEN_ID] * w.output_len for w in workload for _ in range(w.n)])

        if args.fit_from_trace:
            cost = trace_cost_model(args.trace, out)
        else:
            cost = CostModel.load(args.cost_model) if args.cost_model else CostModel.default()
        print(f"{len(jobs)} simulated run(s){' on Ray' if args.ray else ''} ...", flush=True)
        results = [
            (r.records, r.summary, {**r.details, "cost_model": cost.description})
            for r in run_jobs(jobs, workload, cost, args.ray)
        ]

    runs: list[RunReport] = []
    eviction_rows: list[EvictionRow] = []
    details: dict[str, Any] = {}
    for index, (job, (records, summary, extra)) in enumerate(zip(jobs, results, strict=True)):
        label, config = job.label, job.config
        ps, pool = config.page_size, int(extra.get("pages_total") or 0)
        run = RunReport(
            label,
            config.policy,
            summary,
            records,
            bound("infinite", ps, run=index),
            pool_hit_rate=bound("pool", ps, pool, index),
            arrival_hit_rate=bound("arrival", ps, pool, index),
            slo=slo,
            admission_blocked=extra.get("admission_blocked"),
            engine_stats=extra.get("scheduler_stats") or extra.get("engine_stats"),
            length_predictor=extra.get("length_predictor")
            or (extra.get("engine_stats") or {}).get("length_predictor"),
            shadow=extra.get("shadow"),
            peak_waiting=extra.get("peak_waiting"),
        )
        runs.append(run)
        if args.eviction and pool:
            stats = extra.get("scheduler_stats") or extra.get("engine_stats") or {}
            eviction_rows.append(
                EvictionRow(
                    label,
                    label.rpartition(" eviction_policy=")[0],  # the sweep's last axis
                    resolve_eviction_rule(config.eviction_policy).name,
                    round(summary.cache_hit_rate * summary.prompt_tokens),
                    belady_tokens(ps, pool),
                    summary.cache_hit_rate,
                    summary.ttft.p50,
                    summary.output_throughput,
                    int(stats.get("evictions", 0)),
                    int(stats.get("evicted_recomputed_tokens", 0)),
                )
            )
        details[label] = {
            "config": config.to_dict(),
            "summary": summary.to_dict(),
            "optimal_hit_rate": run.optimal_hit_rate,
            "pool_hit_bound": run.pool_hit_rate,
            "arrival_order_hit_bound": run.arrival_hit_rate,
            **({"slo_attainment": slo.attainment(records)} if slo else {}),
            **extra,
        }
        print(
            f"[{label}] {summary.num_completed}/{summary.num_requests} done, "
            f"{summary.output_throughput:.1f} tok/s, TTFT p50 {summary.ttft.p50 * 1e3:.1f} ms, "
            f"hit {summary.cache_hit_rate:.3f} (bounds: infinite {run.optimal_hit_rate:.3f}, "
            f"pool {run.pool_hit_rate:.3f}, arrival order {run.arrival_hit_rate:.3f})",
            flush=True,
        )

    mode_name = "real engine" if args.real else "simulator"
    header = (
        f"# Policy comparison\n\nworkload: `{args.trace or args.workload}` ({len(workload)} "
        f"requests, {sum(len(p) for p in prompts)} prompt tokens), mode: {mode_name}"
    )
    if not args.real:
        header += f", cost model: {next(iter(details.values()))['cost_model']}"
    if closed_note:
        header += f"\n\n{closed_note}"
    if slo is not None:
        header += f", SLO: TTFT <= {slo.ttft} s, TPOT <= {slo.tpot} s"
    sections = [header, markdown_table(runs)]
    failed = failure_note(runs)
    if failed:
        sections.append(failed)
    hint = queue_hint(runs)
    if hint:
        sections.append(hint)
    shadows = shadow_table(runs)
    if shadows:
        sections += ["## Shadow policy agreement", shadows]
    for by in args.group_by:
        sections += [f"## By {by}", group_table(runs, by)]
    predicted = predictor_table(runs)
    if predicted:
        sections += ["## Output-length predictors (against the actual lengths)", predicted]
    if eviction_rows:
        sections += [
            "## Eviction rules against Belady's bound (same pool)",
            eviction_table(eviction_rows),
        ]
    blocked = blocked_table(runs)
    if blocked:
        sections += ["## Why admission stopped (steps, by reason)", blocked]
    (out / "results.md").write_text("\n\n".join(sections), encoding="utf-8")
    (out / "summary.json").write_text(
        json.dumps(details, indent=2, default=str) + "\n", encoding="utf-8"
    )
    if not args.no_figures:
        write_figures(runs, out)
        for by in args.group_by:
            write_group_figure(runs, by, out)
    print("\n\n".join(sections[1:]))
    if outputs_differ:
        raise SystemExit(f"the runs' greedy outputs differ: {out / 'results.md'}")
    return runs


if __name__ == "__main__":
    run_main(main)
