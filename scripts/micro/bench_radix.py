"""Micro-benchmark of the radix prefix cache on a shared-prefix trace.

Trace: ``--num-seqs`` sequences of 64-512 tokens, each a system prompt (one of
``--num-system-prompts``) followed by a random suffix. They are inserted into an empty tree;
then ``--num-queries`` queries are matched, half of them inserted sequences, half new sequences
sharing a system prompt; each query's matched node is locked and unlocked; finally the tree is
evicted in steps of 1% of its size until empty. Every phase is timed over ``--repeats`` fresh
runs and the median is reported, per page size, as operations per wall-clock second and per
second of this process's CPU time (the latter is what to compare on a machine other jobs load;
the load average is recorded with the results). The garbage collector stays enabled; objects
that exist before the runs (torch's, the trace) are frozen out of its view first, as an engine
would after start-up (``--no-gc-freeze`` to keep them in).

    python scripts/micro/bench_radix.py [--page-sizes 1 16] [--out bench_results/bench_radix.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncengine.cache import RadixCache
from asyncengine.script_main import run_main

# Targets on the 2-core development machine (ops per second).
TARGETS = {1: {"insert": 30_000, "match": 30_000}, 16: {"insert": 60_000, "match": 60_000}}


@dataclass(slots=True)
class Trace:
    sequences: list[list[int]]
    queries: list[list[int]]


@dataclass(slots=True)
class Elapsed:
    wall_s: float
    cpu_s: float  # this process's CPU time: robust to other load on the machine


class Stopwatch:
    def __enter__(self) -> Stopwatch:
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = Elapsed(time.perf_counter() - self._wall, time.process_time() - self._cpu)


@dataclass(slots=True)
class RunTimes:
    phases: dict[str, Elapsed]  # insert, match, lock_unlock, evict
    evict_calls: int
    nodes: int
    tokens_in_tree: int
    matched_tokens: int
    query_tokens: int


@dataclass(slots=True)
class Result:
    page_size: int
    ops: dict[str, int]  # operations per phase
    wall_ops_per_s: dict[str, float]  # median over repeats
    cpu_ops_per_s: dict[str, float]  # median over repeats
    evicted_tokens_per_cpu_s: float
    nodes: int
    tokens_in_tree: int
    query_hit_rate: float
    meets_target_wall: bool
    meets_target_cpu: bool


def make_trace(
    num_seqs: int, num_queries: int, num_system_prompts: int, vocab: int, seed: int
) -> Trace:
    rng = np.random.default_rng(seed)
    system_prompts = [
        rng.integers(0, vocab, int(rng.integers(16, 192))).tolist()
        for _ in range(num_system_prompts)
    ]

    def new_sequence() -> list[int]:
        prompt = system_prompts[int(rng.integers(num_system_prompts))]
        length = max(int(rng.integers(64, 513)), len(prompt) + 8)
        return prompt + rng.integers(0, vocab, length - len(prompt)).tolist()

    sequences = [new_sequence() for _ in range(num_seqs)]
    queries: list[list[int]] = []
    for index in range(num_queries):
        if index % 2 == 0:
            queries.append(sequences[int(rng.integers(num_seqs))])
        else:
            queries.append(new_sequence())
    order = rng.permutation(num_queries)
    return Trace(sequences, [queries[i] for i in order])


def run_once(trace: Trace, page_size: int) -> RunTimes:
    tree = RadixCache(page_size)
    page_ids: list[np.ndarray] = []
    next_page = 0
    for seq in trace.sequences:
        count = len(seq) // page_size
        page_ids.append(np.arange(next_page, next_page + count, dtype=np.int32))
        next_page += count
    phases: dict[str, Elapsed] = {}

    insert = tree.insert
    with Stopwatch() as watch:
        for seq, ids in zip(trace.sequences, page_ids, strict=True):
            insert(seq, ids)
    phases["insert"] = watch.elapsed
    nodes = tree.num_nodes()
    tokens_in_tree = tree.total_size

    match = tree.match_prefix
    with Stopwatch() as watch:
        matches = [match(query) for query in trace.queries]
    phases["match"] = watch.elapsed

    lock, unlock = tree.lock, tree.unlock
    last_nodes = [node for _, _, node in matches]
    with Stopwatch() as watch:
        for node in last_nodes:
            lock(node)
            unlock(node)
    phases["lock_unlock"] = watch.elapsed

    step = max(page_size, tree.total_size // 100)
    evict_calls = 0
    with Stopwatch() as watch:
        while tree.evictable_size:
            tree.evict(step)
            evict_calls += 1
    phases["evict"] = watch.elapsed
    assert tree.total_size == 0, "the benchmark tree should evict completely"
    return RunTimes(
        phases=phases,
        evict_calls=evict_calls,
        nodes=nodes,
        tokens_in_tree=tokens_in_tree,
        matched_tokens=sum(matched for _, matched, _ in matches),
        query_tokens=sum(len(query) for query in trace.queries),
    )


def summarize(trace: Trace, page_size: int, runs: list[RunTimes]) -> Result:
    first = runs[0]
    ops = {
        "insert": len(trace.sequences),
        "match": len(trace.queries),
        "lock_unlock": len(trace.queries),
        "evict": first.evict_calls,
    }

    def rates(clock: str) -> dict[str, float]:
        return {
            phase: count / statistics.median(getattr(r.phases[phase], clock) for r in runs)
            for phase, count in ops.items()
        }

    wall, cpu = rates("wall_s"), rates("cpu_s")
    target = TARGETS.get(page_size, {})

    def meets(measured: dict[str, float]) -> bool:
        return all(measured[phase] >= goal for phase, goal in target.items())

    evict_cpu = statistics.median(r.phases["evict"].cpu_s for r in runs)
    return Result(
        page_size=page_size,
        ops=ops,
        wall_ops_per_s=wall,
        cpu_ops_per_s=cpu,
        evicted_tokens_per_cpu_s=first.tokens_in_tree / evict_cpu,
        nodes=first.nodes,
        tokens_in_tree=first.tokens_in_tree,
        query_hit_rate=first.matched_tokens / max(1, first.query_tokens),
        meets_target_wall=meets(wall),
        meets_target_cpu=meets(cpu),
    )


def print_table(results: list[Result]) -> None:
    header = (
        f"{'page':>4} {'clock':>5} {'insert/s':>10} {'match/s':>10} {'lock+unlock/s':>14} "
        f"{'evict calls/s':>14} {'target':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        for clock, rates, met in (
            ("wall", r.wall_ops_per_s, r.meets_target_wall),
            ("cpu", r.cpu_ops_per_s, r.meets_target_cpu),
        ):
            print(
                f"{r.page_size:>4} {clock:>5} {rates['insert']:>10,.0f} {rates['match']:>10,.0f} "
                f"{rates['lock_unlock']:>14,.0f} {rates['evict']:>14,.0f} "
                f"{'met' if met else 'MISSED':>7}"
            )
    for r in results:
        print(
            f"page {r.page_size}: {r.nodes:,} nodes, {r.tokens_in_tree:,} tokens in the tree, "
            f"query hit rate {r.query_hit_rate:.1%}, "
            f"eviction {r.evicted_tokens_per_cpu_s:,.0f} tokens per CPU second"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=20_000)
    parser.add_argument("--num-queries", type=int, default=20_000)
    parser.add_argument("--num-system-prompts", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave import-time objects and the trace in the garbage collector's view",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/bench_radix.json"))
    args = parser.parse_args()

    trace = make_trace(
        args.num_seqs, args.num_queries, args.num_system_prompts, args.vocab, args.seed
    )
    if not args.no_gc_freeze:
        # As a serving engine does after start-up: objects that live for the whole process
        # (torch's import-time objects, here also the trace) leave the collector's view, so a
        # full collection does not re-walk them. The collector stays on for the tree's objects.
        gc.collect()
        gc.freeze()
    load_before = os.getloadavg()[0]
    results: list[Result] = []
    for page_size in args.page_sizes:
        runs = []
        for _ in range(args.repeats):
            gc.collect()
            runs.append(run_once(trace, page_size))
        results.append(summarize(trace, page_size, runs))
    print_table(results)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "radix_cache",
        "trace": {
            "num_seqs": args.num_seqs,
            "num_queries": args.num_queries,
            "num_system_prompts": args.num_system_prompts,
            "seq_len_range": [64, 512],
            "vocab": args.vocab,
            "seed": args.seed,
        },
        "repeats": args.repeats,
        "statistic": "median over repeats",
        "gc_freeze": not args.no_gc_freeze,
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "load_average_1m_before": load_before,
            "load_average_1m_after": os.getloadavg()[0],
        },
        "targets_ops_per_s": {str(k): v for k, v in TARGETS.items()},
        "results": [asdict(r) for r in results],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
